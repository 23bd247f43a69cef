"""Overhead benchmark: what a router itself costs, against going direct to the replica.

    python -m loadtest.bench.overhead            # ~6 min: every rate, every router
    python -m loadtest.bench.overhead --quick    # ~1.5 min

1. Added latency. Two zero-delay simulated replicas (--time-factor 0: no prefill or decode
   sleeps, only the simulator's own Python), reached directly and through cachelane
   (cache_aware, one worker process), sglang-router and vllm-router (cache_aware). Open loop at
   fixed rates, streaming and not, over kept-alive connections (as production clients and the
   openai SDK do). Added latency = router percentile - direct percentile at the same rate.
2. Maximum throughput: closed loop, CONCURRENCY requests in flight, non-streaming; requests/s
   and requests per CPU-second of the router process (a worker's ceiling if it had a core).
3. Decision time in-process (no HTTP): canonical prompt text, block hashes, index lookup
   (memory, and Redis on a throwaway redis-server) and decide(cache_aware), for 1k/8k/32k-token
   prompts over 4/16/64 replicas that hold prefixes of different lengths.

The stack's floor, arms taking turns and ratios to it: loadtest/bench/overhead_floor.py.

Machine caveat: client, routers and replica share the same cores; compare routers as ratios
within one run, not the absolute numbers across machines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from gateway.index.redis_backend import RedisIndex
from loadtest.bench import figures, harness, report
from loadtest.bench.peer_routers import (
    RouterSpec,
    ensure_installed,
    running_router,
    with_workers,
)
from loadtest.bench.processes import SimFleetSettings, sim_fleet
from loadtest.bench.redis_servers import RedisMissing, RedisServer
from loadtest.sim.config import SIM_MODEL
from loadtest.workloads import traces
from routing.cost import HBM_CAPACITY_TOKENS, Load, PoolCosts
from routing.decide import Candidate, Policy, RouteRequest, decide
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS, PrefixHasher
from routing.index import Index, MemoryIndex
from routing.prompt import approx_tokens, chat_text
from routing.types import Location, Tier
from routing.whatif.summary import percentile

OUT_PATH = Path("results/bench_overhead.json")
PLOT_PATH = Path("results/bench_overhead.png")

RATES_PER_S = (25, 50, 100, 200, 400)
QUICK_RATES_PER_S = (50, 100, 200)
# Up to where this 2-core box saturates (client + router + replica all in Python but the Rust
# routers); 100 req/s is the target rate.
RATE_DURATION_S = 6.0  # per rate: 600 requests at 100/s, so p99 rests on ~6 samples above it
QUICK_RATE_DURATION_S = 3.0
WARMUP_REQUESTS = 30  # opens the kept-alive connections and warms caches before timing
PROMPT_TOKENS = 256  # a short chat turn: the proxying cost, not the prompt's size, is measured
MAX_TOKENS = 8  # a few streamed chunks after the first
SATURATED_LAG_S = 0.25  # a rate whose p99 send lag exceeds this is past saturation: stop there
REQUEST_TIMEOUT_S = 10.0
CONCURRENCY = 32  # closed loop for max throughput: enough to keep one worker busy
THROUGHPUT_S = 6.0
QUICK_THROUGHPUT_S = 3.0

DECISION_TOKENS = (1_024, 8_192, 32_768)
DECISION_REPLICAS = (4, 16, 64)
DECISION_ITERATIONS = 300  # per cell; p99 over 3 samples above it
DECISION_BUDGET_S = 3.0  # per cell, so a slow backend cannot stall the run
SEED = 5

ROUTERS = (
    RouterSpec("cachelane", "cache_aware"),
    RouterSpec("bare", "round_robin"),  # the stack's floor (loadtest/bench/bare_proxy.py)
    RouterSpec("sglang", "cache_aware"),
    RouterSpec("vllm", "cache_aware"),
)
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# --- the zero-delay fleet --------------------------------------------------------------------


@contextlib.contextmanager
def zero_delay_fleet(log_dir: Path, replicas: int = 2) -> Iterator[list[str]]:
    """Replicas that answer at once: only the simulator's own Python remains."""
    settings = SimFleetSettings(
        replicas=replicas, hbm_capacity_tokens=HBM_CAPACITY_TOKENS, time_factor=0.0, itl_ms=0.0
    )
    with sim_fleet(settings, log_dir) as fleet:
        yield fleet.urls


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of a process and its descendants alive now (all their threads; `serve
    --workers N`: the supervisor and its workers), from /proc; 0 where there is no /proc."""
    if pid is None:
        return 0.0
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, cpu seconds)
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = path.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(path.parent.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])))
    tree, total = [pid], 0.0
    while tree:
        current = tree.pop()
        total += stats.get(current, (0, 0.0))[1] / CLK_TCK
        tree += [child for child, (parent, _) in stats.items() if parent == current]
    return total


# --- open-loop client ------------------------------------------------------------------------


def _body(i: int, stream: bool) -> dict[str, Any]:
    rng = random.Random(f"{SEED}-{i}")
    return chat_body(f"Request {i}. " + traces.words_text(rng, PROMPT_TOKENS), stream)


def chat_body(text: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": SIM_MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": MAX_TOKENS,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Sample:
    e2e_s: float | None = None
    ttft_s: float | None = None
    lag_s: float = 0.0
    error: str | None = None


async def _one(client: aiohttp.ClientSession, body: dict[str, Any], sample: Sample) -> None:
    started = time.perf_counter()
    try:
        async with client.post("/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                sample.error = f"HTTP {resp.status}"
                return
            if body["stream"]:
                async for line in resp.content:  # one SSE line at a time, as it arrives
                    if (
                        sample.ttft_s is None
                        and b'"content":"' in line
                        and b'"content":""' not in line
                    ):
                        sample.ttft_s = time.perf_counter() - started
            else:
                await resp.read()
                sample.ttft_s = time.perf_counter() - started
        sample.e2e_s = time.perf_counter() - started
    except (aiohttp.ClientError, TimeoutError) as err:
        sample.error = f"{type(err).__name__}: {err}"


@contextlib.asynccontextmanager
async def _client(base_url: str) -> AsyncIterator[aiohttp.ClientSession]:
    """aiohttp, kept-alive connections: a client light enough not to be the bottleneck (httpx's
    pool costs ~4 ms of CPU per request at this concurrency: loadtest/bench/upstream.py)."""
    connector = aiohttp.TCPConnector(limit=256)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(
        base_url=base_url, connector=connector, timeout=timeout, trust_env=False
    ) as client:
        yield client


async def open_loop(
    base_url: str, rate_per_s: float, duration_s: float, stream: bool
) -> dict[str, Any]:
    n = int(rate_per_s * duration_s)
    bodies = [_body(i, stream) for i in range(n + WARMUP_REQUESTS)]
    samples = [Sample() for _ in range(n)]
    async with _client(base_url) as client:
        await asyncio.gather(*(_one(client, b, Sample()) for b in bodies[:WARMUP_REQUESTS]))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tasks = []
        for i, sample in enumerate(samples):
            delay = t0 + i / rate_per_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            sample.lag_s = max(0.0, loop.time() - t0 - i / rate_per_s)
            tasks.append(asyncio.create_task(_one(client, bodies[WARMUP_REQUESTS + i], sample)))
        await asyncio.wait(tasks, timeout=duration_s + REQUEST_TIMEOUT_S)
        for task in tasks:
            task.cancel()
        elapsed_s = loop.time() - t0
    ok = [s for s in samples if s.error is None and s.e2e_s is not None]
    e2e = [s.e2e_s * 1000 for s in ok if s.e2e_s is not None]
    ttft = [s.ttft_s * 1000 for s in ok if s.ttft_s is not None]
    return {
        "rate_per_s": rate_per_s,
        "stream": stream,
        "requests": n,
        "errors": n - len(ok),
        "achieved_per_s": len(ok) / elapsed_s if elapsed_s else 0.0,
        "send_lag_p99_ms": percentile([s.lag_s * 1000 for s in samples], 99),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "e2e_p50_ms": percentile(e2e, 50),
        "e2e_p99_ms": percentile(e2e, 99),
    }


def _plain_body(worker: int, i: int) -> dict[str, Any]:
    return _body(worker * 100_000 + i, False)


async def closed_loop(
    base_url: str,
    duration_s: float,
    *,
    body: Callable[[int, int], dict[str, Any]] = _plain_body,
    concurrency: int = CONCURRENCY,
) -> tuple[int, int, float]:
    """(ok, errors, elapsed_s) with `concurrency` workers each sending, one after the other,
    non-streaming requests `body(worker, i)` for its i-th request."""
    counts = {"ok": 0, "err": 0}
    async with _client(base_url) as client:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + duration_s

        async def worker(w: int) -> None:
            i = 0
            while loop.time() < deadline:
                sample = Sample()
                await _one(client, body(w, i), sample)
                counts["ok" if sample.error is None else "err"] += 1
                i += 1

        started = loop.time()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        return counts["ok"], counts["err"], loop.time() - started


# --- part 1 and 2: HTTP ----------------------------------------------------------------------


def baseline_tree(ref: str, log_dir: Path) -> RouterSpec:
    """cachelane as it was at git `ref` (its gateway/ and routing/ extracted from this
    repository), to run beside the current code in the same run: before/after as ratios."""
    tree = log_dir / f"baseline-{ref}"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", ref, "gateway", "routing"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return RouterSpec("cachelane", "cache_aware", label_suffix=f"@{ref}", source=tree)


def bench_http(
    console: Console,
    log_dir: Path,
    rates: Sequence[int],
    rate_s: float,
    tput_s: float,
    extra: Sequence[RouterSpec] = (),
) -> dict[str, Any]:
    targets: list[RouterSpec | None] = [None, *ROUTERS[:1], *extra, *ROUTERS[1:]]
    out: dict[str, Any] = {"latency": {}, "throughput": {}, "not_run": {}}
    with zero_delay_fleet(log_dir) as urls:
        for spec in targets:
            label = "direct" if spec is None else spec.label
            if spec is not None and spec.kind != "cachelane":
                error = ensure_installed(spec.kind)
                if error:
                    out["not_run"][label] = error
                    console.print(f"[red]{label}: {error}")
                    continue
            with contextlib.ExitStack() as stack:
                try:
                    if spec is None:
                        url, pid = urls[0], None
                    else:
                        router = stack.enter_context(running_router(spec, urls, log_dir))
                        url, pid = router.url, router.pid
                except (RuntimeError, OSError) as err:
                    out["not_run"][label] = str(err).splitlines()[0]
                    console.print(f"[red]{label}: {err}")
                    continue
                rows = []
                for stream in (False, True):
                    for rate in rates:
                        row = asyncio.run(open_loop(url, rate, rate_s, stream))
                        rows.append(row)
                        console.print(
                            f"  {label:<22} {'stream' if stream else 'plain ':<6} {rate:>4}/s: "
                            f"TTFT p50 {row['ttft_p50_ms']:.2f} p99 {row['ttft_p99_ms']:.2f} ms,"
                            f" achieved {row['achieved_per_s']:.0f}/s, errors {row['errors']}"
                        )
                        if row["send_lag_p99_ms"] > SATURATED_LAG_S * 1000:
                            break  # past saturation: higher rates only measure the queue
                out["latency"][label] = rows
                cpu_before = cpu_seconds(pid)
                ok, errors, elapsed_s = asyncio.run(closed_loop(url, tput_s))
                cpu_s = cpu_seconds(pid) - cpu_before
                out["throughput"][label] = {
                    "requests_per_s": ok / elapsed_s,
                    "errors": errors,
                    "router_cpu_s": cpu_s if pid else None,
                    "requests_per_cpu_s": ok / cpu_s if pid and cpu_s else None,
                }
    return out


def added_latency(http: dict[str, Any]) -> list[dict[str, Any]]:
    """Router minus direct, per (stream, rate), for the percentiles of TTFT and e2e."""
    direct = {(r["stream"], r["rate_per_s"]): r for r in http["latency"].get("direct", [])}
    rows = []
    for label, runs in http["latency"].items():
        if label == "direct":
            continue
        for r in runs:
            d = direct.get((r["stream"], r["rate_per_s"]))
            if d is None:
                continue
            rows.append(
                {
                    "router": label,
                    "stream": r["stream"],
                    "rate_per_s": r["rate_per_s"],
                    "added_ttft_p50_ms": r["ttft_p50_ms"] - d["ttft_p50_ms"],
                    "added_ttft_p99_ms": r["ttft_p99_ms"] - d["ttft_p99_ms"],
                    "added_e2e_p50_ms": r["e2e_p50_ms"] - d["e2e_p50_ms"],
                    "added_e2e_p99_ms": r["e2e_p99_ms"] - d["e2e_p99_ms"],
                    "achieved_per_s": r["achieved_per_s"],
                    "direct_achieved_per_s": d["achieved_per_s"],
                    "errors": r["errors"],
                }
            )
    return rows


# --- part 3: decision time -------------------------------------------------------------------


async def _fill(index: Index, hashes: list[int], replicas: int) -> None:
    for i in range(replicas):
        blocks = max(1, len(hashes) * (i + 1) // replicas)
        await index.record(SIM_MODEL, hashes[:blocks], Location(f"r{i}", Tier.HBM))


QUESTION_TOKENS = 64  # each decision's prompt: a prefix sent before, then a new question


async def bench_decision(backends: dict[str, Index], budget_s: float) -> list[dict[str, Any]]:
    """The gateway's decision path on a prompt whose first tokens - QUESTION_TOKENS were sent
    before (a document, a system prompt, earlier turns) and whose question is new, as most
    requests are; `hash_unique` hashes a prompt of the same length that shares nothing."""
    rows: list[dict[str, Any]] = []
    rng = random.Random(SEED)
    for tokens in DECISION_TOKENS:
        prefix = traces.words_text(rng, tokens - QUESTION_TOKENS)
        questions = [traces.words_text(rng, QUESTION_TOKENS) for _ in range(50)]
        for replicas in DECISION_REPLICAS:
            # every replica holds a different share of the prefix; half are busy
            loads = [
                Load(in_flight=i % 8, pending_prefill_tokens=(i % 4) * 2048)
                for i in range(replicas)
            ]
            # one pool: its replicas share one PoolCosts, as the gateway's do
            costs = PoolCosts()
            candidates = [Candidate(f"r{i}", load=loads[i], costs=costs) for i in range(replicas)]
            for name, index in backends.items():
                namespace = f"{SIM_MODEL}|{name}-{tokens}-{replicas}"
                hasher = PrefixHasher()  # the gateway's (gateway/serving/planner.py)
                strangers = PrefixHasher()  # unique prompts only, so they evict none of hasher's
                sent = [{"role": "user", "content": prefix}]
                await _fill(
                    index, hasher.block_hashes(chat_text(sent), namespace=namespace), replicas
                )
                parts: dict[str, list[float]] = {
                    "hash": [],
                    "lookup": [],
                    "decide": [],
                    "total": [],
                    "hash_unique": [],
                }
                decide_rng = random.Random(SEED)
                deadline = time.monotonic() + budget_s
                for i in range(DECISION_ITERATIONS + 10):
                    if time.monotonic() > deadline:
                        break
                    messages = [{"role": "user", "content": prefix + questions[i % 50]}]
                    t0 = time.perf_counter()
                    prompt = chat_text(messages)
                    hs = hasher.block_hashes(prompt, namespace=namespace)
                    t1 = time.perf_counter()
                    hits = await index.lookup(SIM_MODEL, hs)
                    t2 = time.perf_counter()
                    request = RouteRequest(hs, approx_tokens(prompt), DEFAULT_BLOCK_SIZE_TOKENS)
                    decide(request, candidates, hits, Policy.CACHE_AWARE, seq=i, rng=decide_rng)
                    t3 = time.perf_counter()
                    strangers.block_hashes(prompt, namespace=f"{namespace}-unique-{i}")
                    t4 = time.perf_counter()
                    if i < 10:
                        continue  # warm-up
                    parts["hash"].append((t1 - t0) * 1e3)
                    parts["lookup"].append((t2 - t1) * 1e3)
                    parts["decide"].append((t3 - t2) * 1e3)
                    parts["total"].append((t3 - t0) * 1e3)
                    parts["hash_unique"].append((t4 - t3) * 1e3)
                row: dict[str, Any] = {
                    "backend": name,
                    "prompt_tokens": tokens,
                    "replicas": replicas,
                    "iterations": len(parts["total"]),
                }
                for part, values in parts.items():
                    row[f"{part}_p50_ms"] = statistics.median(values) if values else float("nan")
                    row[f"{part}_p99_ms"] = percentile(values, 99)
                rows.append(row)
    return rows


async def run_decision(console: Console, budget_s: float) -> list[dict[str, Any]]:
    backends: dict[str, Index] = {"memory": MemoryIndex()}
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(RedisServer())
            backends["redis"] = RedisIndex.from_url(
                server.url, key_prefix="overhead", socket_timeout_s=5.0
            )
        except (RedisMissing, RuntimeError, OSError) as err:
            console.print(f"[yellow]no Redis for the decision benchmark: {err}")
        try:
            return await bench_decision(backends, budget_s)
        finally:
            for index in backends.values():
                await index.close()


# --- output ----------------------------------------------------------------------------------


def _f(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return f"{value:,.{digits}f}"


def print_tables(console: Console, payload: dict[str, Any]) -> None:
    t = Table(title="added latency vs direct (router percentile - direct percentile, ms)")
    columns: tuple[str, ...] = (
        "router", "mode", "rate/s", "TTFT p50", "TTFT p99", "e2e p50", "e2e p99", "achieved/s",
        "err",
    )  # fmt: skip
    report.add_columns(t, columns, left=("router", "mode"))
    for r in payload["added"]:
        t.add_row(
            r["router"], "stream" if r["stream"] else "plain", str(r["rate_per_s"]),
            _f(r["added_ttft_p50_ms"]), _f(r["added_ttft_p99_ms"]), _f(r["added_e2e_p50_ms"]),
            _f(r["added_e2e_p99_ms"]), _f(r["achieved_per_s"], 0), str(r["errors"]),
        )  # fmt: skip
    console.print(t)
    t = Table(title=f"max throughput, closed loop, {CONCURRENCY} in flight, non-streaming")
    columns = ("target", "req/s", "router CPU s", "req per router CPU-second", "errors")
    report.add_columns(t, columns, left=("target",))
    for label, r in payload["http"]["throughput"].items():
        t.add_row(
            label, _f(r["requests_per_s"], 0), _f(r["router_cpu_s"]),
            _f(r["requests_per_cpu_s"], 0), str(r["errors"]),
        )  # fmt: skip
    console.print(t)
    t = Table(title="routing decision in-process: prompt text + hash + lookup + decide (ms)")
    columns = (
        "index", "tokens", "replicas", "n", "hash p50", "lookup p50", "decide p50", "total p50",
        "total p99", "unique prompt: hash p50",
    )  # fmt: skip
    report.add_columns(t, columns, left=("index",))
    for r in payload["decision"]:
        t.add_row(
            r["backend"], str(r["prompt_tokens"]), str(r["replicas"]), str(r["iterations"]),
            _f(r["hash_p50_ms"], 3), _f(r["lookup_p50_ms"], 3), _f(r["decide_p50_ms"], 3),
            _f(r["total_p50_ms"], 3), _f(r["total_p99_ms"], 3), _f(r.get("hash_unique_p50_ms"), 3),
        )  # fmt: skip
    console.print(t)
    harness.print_not_run(console, payload["http"]["not_run"])


def plot(path: Path, payload: dict[str, Any]) -> None:
    plt = figures.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=False)
    for ax, stream in zip(axes, (False, True), strict=True):
        for label in sorted({r["router"] for r in payload["added"]}):
            rows = [r for r in payload["added"] if r["router"] == label and r["stream"] == stream]
            xs = [r["rate_per_s"] for r in rows]
            ax.plot(xs, [r["added_ttft_p50_ms"] for r in rows], "o-", label=f"{label} p50")
            ax.plot(xs, [r["added_ttft_p99_ms"] for r in rows], "x--", label=f"{label} p99")
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1)
        ax.set_xlabel("offered requests/s")
        ax.set_ylabel("added TTFT vs direct (ms, symlog)")
        ax.set_title("streaming (time to first token)" if stream else "non-streaming (response)")
        ax.axhline(1, color="tab:red", linewidth=0.8, linestyle=":")
        ax.axhline(5, color="tab:red", linewidth=0.8, linestyle=":")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    figures.save_figure(fig, path, dpi=100)


def main(argv: Sequence[str] | None = None) -> int:
    parser = harness.parser(
        "overhead",
        "Gateway-added latency and throughput vs direct and vs sglang-router and "
        "vllm-router; routing decision time in-process.",
        quick="fewer rates, shorter runs",
    )
    parser.add_argument("--skip-http", action="store_true", help="only the decision benchmark")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="also run cachelane with `serve --workers N` (N > 1) beside the one-worker run",
    )
    parser.add_argument(
        "--baseline",
        metavar="GIT_REF",
        help="also run cachelane as it was at this commit (before/after in one run)",
    )
    parser.add_argument("--out", type=Path, default=OUT_PATH)
    parser.add_argument("--plot", type=Path, default=PLOT_PATH)
    args = parser.parse_args(argv)
    console = Console(width=150)
    log_dir = args.out.parent / "bench_overhead_logs"
    started = time.perf_counter()
    rates = QUICK_RATES_PER_S if args.quick else RATES_PER_S
    rate_s = QUICK_RATE_DURATION_S if args.quick else RATE_DURATION_S
    tput_s = QUICK_THROUGHPUT_S if args.quick else THROUGHPUT_S
    http: dict[str, Any] = {"latency": {}, "throughput": {}, "not_run": {}}
    try:
        if not args.skip_http:
            extra = [baseline_tree(args.baseline, log_dir)] if args.baseline else []
            if args.workers > 1:
                extra.append(with_workers(ROUTERS[0], args.workers))
            http = bench_http(console, log_dir, rates, rate_s, tput_s, extra)
        decision = asyncio.run(run_decision(console, DECISION_BUDGET_S / (3 if args.quick else 1)))
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; every process was stopped")
        return 130
    payload = {
        "settings": {
            "rates_per_s": list(rates),
            "rate_duration_s": rate_s,
            "prompt_tokens": PROMPT_TOKENS,
            "max_tokens": MAX_TOKENS,
            "concurrency": CONCURRENCY,
            "cpus": os.cpu_count(),
            "routers": [asdict(r) | {"label": r.label} for r in ROUTERS],
        },
        "http": http,
        "added": added_latency(http),
        "decision": decision,
        "wall_time_s": time.perf_counter() - started,
    }
    report.write_json(args.out, payload)
    clean = report.clean_floats(payload)
    print_tables(console, payload)
    if payload["added"]:
        plot(args.plot, clean)
    console.print(
        f"wrote {args.out} ({'and ' + str(args.plot) if payload['added'] else ''}) "
        f"in {payload['wall_time_s']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
