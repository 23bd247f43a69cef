"""Upstream client benchmark: which HTTP client should carry the proxied requests?

    python -m loadtest.bench.upstream            # ~1 min
    python -m loadtest.bench.upstream --quick    # ~20 s

One zero-delay simulated replica (as in loadtest/bench/overhead.py); this process sends it the
same chat requests the way gateway/serving/proxy.py does (the client's bytes as the body, the answer
read as a stream: whole for non-streaming, chunk by chunk for streaming), CONCURRENCY in flight over
kept-alive connections, with each client in turn, interleaved in ROUNDS so that the machine's
drift falls on every client alike. What counts is this process's CPU time per request (the
replica runs in another process): the gateway's cost of talking to its replicas.

Clients: httpx with its default transport (httpcore), httpx with the aiohttp transport
(httpx-aiohttp), and aiohttp directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from rich.console import Console
from rich.table import Table

from loadtest.bench import harness, report
from loadtest.bench.overhead import _body, zero_delay_fleet

OUT_PATH = Path("results/bench_upstream.json")
CONCURRENCY = 32  # as the overhead benchmark's closed loop
REQUESTS = 1_500  # per client, stream mode and round
QUICK_REQUESTS = 500
ROUNDS = 3

Send = Callable[[bytes, bool], Awaitable[int]]


@contextlib.asynccontextmanager
async def httpx_client(url: str, transport: str) -> AsyncIterator[Send]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64, keepalive_expiry=60)
    kwargs: dict[str, Any] = {"limits": limits, "timeout": 10.0, "trust_env": False}
    if transport == "aiohttp":
        from httpx_aiohttp import AiohttpTransport

        kwargs["transport"] = AiohttpTransport(limits=limits, trust_env=False)
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(**kwargs) as client:

        async def send(body: bytes, stream: bool) -> int:
            request = client.build_request(
                "POST", url + "/v1/chat/completions", content=body, headers=headers
            )
            resp = await client.send(request, stream=True)
            try:
                n = 0
                async for chunk in resp.aiter_raw():
                    n += len(chunk)
                return n
            finally:
                await resp.aclose()

        yield send


@contextlib.asynccontextmanager
async def aiohttp_client(url: str) -> AsyncIterator[Send]:
    connector = aiohttp.TCPConnector(limit=64, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=10.0)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False, skip_auto_headers=["*"]
    ) as session:

        async def send(body: bytes, stream: bool) -> int:
            async with session.post(
                url + "/v1/chat/completions", data=body, headers=headers
            ) as resp:
                n = 0
                async for chunk in resp.content.iter_any():
                    n += len(chunk)
                return n

        yield send


CLIENTS: dict[str, Callable[[str], contextlib.AbstractAsyncContextManager[Send]]] = {
    "httpx (httpcore)": lambda url: httpx_client(url, "default"),
    "httpx + aiohttp transport": lambda url: httpx_client(url, "aiohttp"),
    "aiohttp": aiohttp_client,
}


async def run_one(url: str, name: str, stream: bool, requests: int) -> dict[str, float]:
    bodies = [json.dumps(_body(i, stream)).encode() for i in range(requests)]
    async with CLIENTS[name](url) as send:
        await asyncio.gather(*(send(b, stream) for b in bodies[:CONCURRENCY]))  # warm up
        queue = iter(bodies)
        errors = 0

        async def worker() -> None:
            nonlocal errors
            for body in queue:
                try:
                    if await send(body, stream) == 0:
                        errors += 1
                except Exception:
                    errors += 1

        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    return {"cpu_s": cpu_s, "wall_s": wall_s, "requests": requests, "errors": errors}


def main(argv: Sequence[str] | None = None) -> int:
    parser = harness.parser(
        "upstream",
        "CPU per proxied request of httpx (httpcore), httpx with the aiohttp "
        "transport, and aiohttp, against one zero-delay simulated replica.",
        quick="fewer requests per round",
    )
    parser.add_argument("--out", type=Path, default=OUT_PATH)
    args = parser.parse_args(argv)
    console = Console(width=150)
    requests = QUICK_REQUESTS if args.quick else REQUESTS
    totals: dict[tuple[str, bool], dict[str, float]] = {}
    with zero_delay_fleet(args.out.parent / "bench_upstream_logs", replicas=1) as urls:
        for _ in range(ROUNDS):
            for stream in (False, True):
                for name in CLIENTS:
                    row = asyncio.run(run_one(urls[0], name, stream, requests))
                    t = totals.setdefault((name, stream), dict.fromkeys(row, 0.0))
                    for k, v in row.items():
                        t[k] += v
    rows: list[dict[str, Any]] = []
    for (name, stream), t in totals.items():
        rows.append(
            {
                "client": name,
                "stream": stream,
                "requests": t["requests"],
                "errors": t["errors"],
                "cpu_us_per_request": t["cpu_s"] / t["requests"] * 1e6,
                "requests_per_s": t["requests"] / t["wall_s"],
            }
        )
    table = Table(title=f"upstream clients, {CONCURRENCY} in flight, {ROUNDS} interleaved rounds")
    for c in ("client", "mode", "CPU us / request", "vs httpx", "req/s", "errors"):
        table.add_column(c, justify="left" if c in ("client", "mode") else "right")
    for r in rows:
        base = next(
            b for b in rows if b["stream"] == r["stream"] and b["client"] == "httpx (httpcore)"
        )
        table.add_row(
            r["client"], "stream" if r["stream"] else "plain", f"{r['cpu_us_per_request']:.0f}",
            f"{r['cpu_us_per_request'] / base['cpu_us_per_request']:.2f}",
            f"{r['requests_per_s']:.0f}", str(int(r["errors"])),
        )  # fmt: skip
    console.print(table)
    report.write_json(args.out, {"concurrency": CONCURRENCY, "rounds": ROUNDS, "rows": rows})
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
