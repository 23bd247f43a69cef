"""The fault probe: a hostile tenant and a failing fleet beside healthy replicas, as clients with
a 15 s timeout see them; then one body as large as the gateway accepts, as /health sees it.

    python -m loadtest.bench.faults                 # 200 requests
    python -m loadtest.bench.faults --requests 60   # shorter
    python -m loadtest.bench.faults --retries 3     # upstream.retries 3

What runs (every process on loopback, started and stopped here): two healthy simulated replicas
(`python -m loadtest.sim`), one more that is paused (SIGSTOP) once the gateway has seen it
healthy, and three loadtest/bench/faulty_replica.py processes: one answering 500, one hanging
(accepts, never answers) and one that breaks its stream mid-way (three events, a bad chunk
header, the connection closed). One `cachelane serve`, with the pool's default deadlines and
health settings, and three tenants: `alpha` and `beta` send the requests (half streamed), each
as an openai client with a 15 s timeout (Envoy's default route timeout) and no retries of its
own, CONCURRENCY at a time; `hostile` sends what no API allows (temperature 10**400, top_p 1.5)
and what makes a replica echo a number past 64 bits (metadata), HOSTILE_EACH of each.

A request is lost when its client saw no answer: a timeout, a transport error, a 5xx. A stream
that began on the mid-stream-garbage replica and then broke is not lost but failed: it ends
with the gateway's error event (nothing can mend a stream after its first byte); the table
counts those apart. Checked: 0 lost; every hostile field refused with 400 and every echo
answered 200; no healthy replica ejected.

Then the body arm: the largest body the gateway accepts (MAX_PROMPT_PARTS content parts filling
max_body_bytes) is sent BODY_SENDS times in a row while /health is asked every HEALTH_EVERY_S;
the table gives /health's p50, p99 and max meanwhile, the same for a body of 200,000 parts
(refused with 400 `too_many_parts`), and for /health alone for IDLE_S (what the machine gives it
without any body: on a machine shared with other jobs, the floor of the other two).

Results: a table, and results/bench_faults.json. Exit code 1 when a check fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
from openai import AsyncOpenAI
from rich.table import Table

from gateway.config.exposure import DEFAULT_MAX_BODY_BYTES
from gateway.http.request_schema import MAX_PROMPT_PARTS
from loadtest.bench import harness, report
from loadtest.bench.processes import (
    ManagedProcess,
    SimFleetSettings,
    free_port,
    gateway_from_config,
    sim_fleet,
    wait_ready,
)
from loadtest.sim.config import SIM_MODEL
from routing.whatif.summary import percentile

OUT_PATH = Path("results/bench_faults.json")
CLIENT_TIMEOUT_S = 15.0  # Envoy's default route timeout
CONCURRENCY = 8
HOSTILE_EACH = 10
BODY_SENDS = 20
IDLE_S = 5.0
HEALTH_EVERY_S = 0.005
HEALTH_P99_GOAL_MS = 50.0
HUGE_PARTS = 200_000
MAX_PROMPT_TOKENS = 100_000  # the body arm's prompts (~2M tokens) are refused once checked
KEYS = {
    name: f"{name}-key-faults-" + "0123456789abcdef" * 2 for name in ("alpha", "beta", "hostile")
}
FAULTS = ("error", "hang", "midgarbage")
# Enough HBM for the run's prompts, and the sims' default speed (loadtest/sim/config.py)
SIMS = SimFleetSettings(replicas=2, hbm_capacity_tokens=200_000, time_factor=1.0)
PAUSED = SimFleetSettings(replicas=1, hbm_capacity_tokens=200_000, time_factor=1.0)


@contextlib.contextmanager
def faulty(mode: str, log_dir: Path) -> Iterator[str]:
    port = free_port()
    args = [sys.executable, "-m", "loadtest.bench.faulty_replica", "--mode", mode]
    args += ["--port", str(port), "--model", SIM_MODEL]
    proc = ManagedProcess(f"faulty replica ({mode})", args, log_dir / f"faulty-{mode}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        proc.start()
        wait_ready(proc, [f"{url}/health"])
        yield url
    finally:
        proc.stop()


def config(urls: Sequence[str], retries: int | None) -> dict[str, Any]:
    upstream = {} if retries is None else {"upstream": {"retries": retries}}
    return upstream | {
        # the largest bodies' prompts are refused after they are parsed and checked (400)
        "pools": [
            {
                "name": "default",
                "models": [SIM_MODEL],
                "replicas": list(urls),
                "max_prompt_tokens": MAX_PROMPT_TOKENS,
            }
        ],
        "tenants": [{"name": name, "api_key": key} for name, key in KEYS.items()],
        "auth": {"mode": "keys"},
        "engine_metrics": {"enabled": False},
    }


async def one(client: AsyncOpenAI, i: int) -> str:
    """One request, half streamed: "ok", "lost: ..." (no answer), or "stream error event" (a
    stream that began and then ended with the gateway's error event, which the openai client
    raises as an APIError)."""
    messages: Any = [{"role": "user", "content": f"request {i}: " + "hello " * 40}]
    seen = 0
    try:
        if i % 2:
            stream = await client.chat.completions.create(
                model=SIM_MODEL, messages=messages, max_tokens=8, stream=True
            )
            async for _ in stream:
                seen += 1
            return "ok" if seen else "lost: an empty stream"
        answer = await client.chat.completions.create(
            model=SIM_MODEL, messages=messages, max_tokens=8
        )
        return "ok" if answer.choices else "lost: no choices"
    except openai.APIError as err:
        if seen and not isinstance(err, openai.APIConnectionError):
            return "stream error event"
        return f"lost: {type(err).__name__}"


async def hostile(url: str) -> Counter[str]:
    """The hostile tenant's requests: (what, status) counts."""
    huge = "1" + "0" * 400  # raw JSON: no parser of this side touches the number
    start = '{"model": "' + SIM_MODEL + '", "input": "hi", '
    bodies = {
        "temperature": start + '"temperature": ' + huge + "}",
        "top_p": start + '"top_p": 1.5}',
        "echo": start + '"max_output_tokens": 2, "metadata": {"x": ' + huge + "}}",
    }
    seen: Counter[str] = Counter()
    headers = {"authorization": f"Bearer {KEYS['hostile']}", "content-type": "application/json"}
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as h:
        for _ in range(HOSTILE_EACH):
            for what, body in bodies.items():
                try:
                    r = await h.post(f"{url}/v1/responses", content=body, headers=headers)
                    seen[f"{what} {r.status_code}"] += 1
                except httpx.HTTPError as err:
                    seen[f"{what} {type(err).__name__}"] += 1
    return seen


async def traffic(url: str, requests: int) -> tuple[Counter[str], Counter[str], float]:
    clients = [
        AsyncOpenAI(
            base_url=f"{url}/v1", api_key=KEYS[name], max_retries=0, timeout=CLIENT_TIMEOUT_S
        )
        for name in ("alpha", "beta")
    ]
    gate = asyncio.Semaphore(CONCURRENCY)

    async def limited(i: int) -> str:
        async with gate:
            return await one(clients[i % 2], i)

    started = time.perf_counter()
    try:
        outcomes, rude = await asyncio.gather(
            asyncio.gather(*(limited(i) for i in range(requests))), hostile(url)
        )
    finally:
        for c in clients:
            await c.close()
    return Counter(outcomes), rude, time.perf_counter() - started


def ejections(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("cachelane_replica_ejections_total{"):
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            out[replica] = out.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def until_healthy(url: str, names: Sequence[str], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = httpx.get(f"{url}/ready", timeout=5).json().get("replicas", {})
        if all(ready.get(n, {}).get("healthy") for n in names):
            return
        time.sleep(0.2)
    raise RuntimeError(f"replicas {list(names)} never healthy")


def big_body(parts: int) -> bytes:
    """A chat body of `parts` content parts (one message holds them) just under max_body_bytes."""
    text = "x" * max(1, (DEFAULT_MAX_BODY_BYTES - 4096) // parts - 30)
    content = [{"type": "text", "text": text}] * (parts - 1)
    body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": content}]}
    return json.dumps(body | {"max_tokens": 1}).encode()


async def health_while(url: str, body: bytes | None) -> tuple[list[float], list[int]]:
    """/health latencies (ms) while `body` is sent BODY_SENDS times; the bodies' statuses.
    None: no body, /health alone for IDLE_S (what the machine gives it)."""
    latencies: list[float] = []
    statuses: list[int] = []
    headers = {"authorization": f"Bearer {KEYS['alpha']}", "content-type": "application/json"}
    async with httpx.AsyncClient(timeout=60) as h:
        done = asyncio.Event()

        async def probe() -> None:
            while not done.is_set():
                t = time.perf_counter()
                await h.get(f"{url}/health")
                latencies.append((time.perf_counter() - t) * 1000)
                await asyncio.sleep(HEALTH_EVERY_S)

        prober = asyncio.create_task(probe())
        try:
            if body is None:
                await asyncio.sleep(IDLE_S)
            for _ in range(0 if body is None else BODY_SENDS):
                r = await h.post(f"{url}/v1/chat/completions", content=body, headers=headers)
                statuses.append(r.status_code)
        finally:
            done.set()
            await prober
    return latencies, statuses


def run(requests: int, retries: int | None, log_dir: Path) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        sims = stack.enter_context(sim_fleet(SIMS, log_dir / "healthy"))
        paused = stack.enter_context(sim_fleet(PAUSED, log_dir / "paused"))
        faults = {m: stack.enter_context(faulty(m, log_dir)) for m in FAULTS}
        urls = [*sims.urls, *paused.urls, *faults.values()]
        gw = stack.enter_context(gateway_from_config(config(urls, retries), log_dir, "faults"))
        names = [u.removeprefix("http://") for u in urls]
        until_healthy(gw.url, names)
        pid = paused.proc.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        stack.callback(os.kill, pid, signal.SIGCONT)  # so that it can be stopped
        outcomes, rude, wall_s = asyncio.run(traffic(gw.url, requests))
        ejected = ejections(gw.url)
        idle = asyncio.run(health_while(gw.url, None))
        small = asyncio.run(health_while(gw.url, big_body(MAX_PROMPT_PARTS)))
        huge = asyncio.run(health_while(gw.url, big_body(HUGE_PARTS)))
    healthy = [u.removeprefix("http://") for u in sims.urls]
    role = dict(zip(names, ["healthy", "healthy", "paused", *FAULTS], strict=True))
    return {
        "requests": requests,
        "retries": retries,
        "outcomes": dict(outcomes),
        "hostile": dict(rude),
        "wall_s": wall_s,
        "ejections": {f"{role[n]} {n}": ejected.get(n, 0.0) for n in names},
        "healthy_ejected": sum(ejected.get(n, 0.0) for n in healthy),
        "body": {
            label: {
                "parts": parts,
                "bytes": len(big_body(parts)) if parts else 0,
                "statuses": statuses,
                "health_ms": {
                    "n": len(lat),
                    "p50": statistics.median(lat) if lat else None,
                    "p99": percentile(lat, 99),
                    "max": max(lat, default=None),
                },
            }
            for label, parts, (lat, statuses) in (
                ("no body", 0, idle),
                ("largest accepted", MAX_PROMPT_PARTS, small),
                ("over the bound", HUGE_PARTS, huge),
            )
        },
    }


def checks(result: dict[str, Any]) -> list[str]:
    failed = []
    lost = sum(n for what, n in result["outcomes"].items() if what.startswith("lost"))
    if lost:
        failed.append(f"{lost} requests lost")
    for what, n in result["hostile"].items():
        field, status = what.split(" ", 1)
        if status != ("200" if field == "echo" else "400"):
            failed.append(f"hostile {field}: {n} answered {status}")
    if result["healthy_ejected"]:
        failed.append("a healthy replica was ejected")
    accepted = result["body"]["largest accepted"]
    if accepted["health_ms"]["p99"] > HEALTH_P99_GOAL_MS:
        failed.append(f"/health p99 {accepted['health_ms']['p99']:.1f} ms while parsing")
    return failed


def table(result: dict[str, Any]) -> Table:
    retries = result["retries"] if result["retries"] is not None else "default"
    t = Table(
        title=f"faults: {result['requests']} requests in {result['wall_s']:.1f} s, retries "
        f"{retries}"
    )
    t.add_column("what")
    t.add_column("count / figure", justify="right")
    for what, n in sorted(result["outcomes"].items()):
        t.add_row(what, str(n))
    for what, n in sorted(result["hostile"].items()):
        t.add_row(f"hostile {what}", str(n))
    for replica, n in result["ejections"].items():
        t.add_row(f"ejections of {replica}", f"{n:g}")
    for label, b in result["body"].items():
        h = b["health_ms"]
        size = f" ({b['parts']:,} parts, {b['bytes'] / 2**20:.1f} MiB) x{BODY_SENDS}"
        t.add_row(
            f"/health, {label}{size if b['parts'] else f' for {IDLE_S:g} s'}",
            f"p50 {h['p50']:.1f} / p99 {h['p99']:.1f} / max {h['max']:.1f} ms "
            f"(n {h['n']}, {sorted(set(b['statuses']))})",
        )
    return t


def main(argv: Sequence[str] | None = None) -> int:
    parser = harness.parser("faults", __doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument(
        "--retries",
        type=int,
        default=None,
        help="upstream.retries (default: the gateway's own, 2): four failing replicas of six "
        "can take three tries before any is ejected",
    )
    parser.add_argument("--out", type=Path, default=OUT_PATH)
    args = parser.parse_args(argv)
    out = harness.console(140)
    logs = harness.log_dir(args.out)
    result: dict[str, Any] = {}

    def arms() -> None:
        result.update(run(args.requests, args.retries, logs))

    code = harness.run_arms(out, "faults", arms)
    if code:
        return code
    out.print(table(result))
    failed = checks(result)
    result["failed_checks"] = failed
    report.write_json(args.out, result)
    for line in failed:
        out.print(f"[red]check failed: {line}")
    out.print(f"wrote {args.out}; logs in {logs}/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
