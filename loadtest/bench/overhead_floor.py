"""cachelane against its stack's floor: the bare proxy, vllm-router and sglang-router, in one run.

    python -m loadtest.bench.overhead_floor            # ~4 min
    python -m loadtest.bench.overhead_floor --quick    # ~30 s: checks the machinery
    python -m loadtest.bench.overhead_floor --arms bare,cachelane --baseline REF  # ~3 min
    python -m loadtest.bench.overhead_floor --workers 2   # ~4 min: and `serve --workers 2`

Every arm runs at once in front of the same two zero-delay simulated replicas (only the
simulator's own Python remains): going direct, the bare proxy (loadtest/bench/bare_proxy.py: the
smallest streaming proxy on cachelane's own server and upstream client, so its cost is the
stack's), the routing floor (the same proxy routing by KV cache with cachelane's routing/ code
and nothing else: its `--route`), cachelane (`serve --replicas`, cache_aware, one worker;
`--workers N` adds `serve --workers N` as one more arm) and the two Rust routers when they
install (loadtest/bench/peer_routers.py). The arms take turns, a block of requests each,
round after round, so a neighbour's load on a shared machine falls on all of them alike; every
figure is also printed as a ratio to the bare proxy's in the same run. `--baseline REF` adds
cachelane as it was at git REF (its gateway/ and routing/) as one more arm, so before/after is
a ratio within one run.

1. Low load: sequential streamed chat requests (256-token prompts, 8 output tokens), one at a
   time over a kept-alive connection; added TTFT = an arm's percentile - direct's.
2. Saturation: a closed loop with CONCURRENCY requests in flight, streamed and not, 256- and
   8k-token prompts; requests per CPU-second of the router's process tree (from /proc), and
   the CPU of this process, the load generator, during each arm's turns (its children, the
   routers and replicas, not counted), so a router's share of a shared machine can be read.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtest.bench import figures, harness, report
from loadtest.bench.overhead import (
    CONCURRENCY,
    MAX_TOKENS,
    Sample,
    _client,
    _one,
    baseline_tree,
    chat_body,
    closed_loop,
    cpu_seconds,
    zero_delay_fleet,
)
from loadtest.bench.peer_routers import RouterSpec, running_router, with_workers
from loadtest.workloads import traces
from routing.whatif.summary import percentile

OUT_PATH = Path("results/bench_overhead_floor.json")
CACHELANE = RouterSpec("cachelane", "cache_aware")
ARMS = (
    RouterSpec("bare", "round_robin"),
    RouterSpec("bare", "cache_aware"),  # the routing floor: the bare proxy's --route
    CACHELANE,
    RouterSpec("vllm", "cache_aware"),
    RouterSpec("sglang", "cache_aware"),
)
FLOOR = "bare:round_robin"
ROUTING_FLOOR = "bare:cache_aware"
DIRECT = "direct"
SHORT_TOKENS, LONG_TOKENS = 256, 8_192  # a chat turn; a document with a question
SEQUENTIAL_PER_ARM, QUICK_SEQUENTIAL_PER_ARM = 400, 20  # p99 rests on 4 samples above it
BLOCK = 20  # sequential requests per arm per turn
WARMUP = 20  # per arm: opens connections, warms caches
SLICE_S, QUICK_SLICE_S = 2.0, 0.3  # one arm's turn in a saturation cell
ROUNDS, QUICK_ROUNDS = 4, 1  # turns per arm per saturation cell
SEED = 7
# The overhead goals (docs/bench/overhead.md), for streamed 256-token prompts: cachelane's added
# TTFT p50 within GOAL_P50_MARGIN_MS of the floor's and at most vllm-router's, its p99 at most
# GOAL_P99_TIMES the floor's; requests per CPU-second at least GOAL_PER_CPU_SHARE of the floor's
# and at least vllm-router's.
GOAL_P50_MARGIN_MS, GOAL_P99_TIMES, GOAL_PER_CPU_SHARE = 0.3, 2.0, 0.7
VLLM = "vllm:cache_aware"


def body_maker(tokens: int, stream: bool) -> Callable[[int, int], dict[str, Any]]:
    """Request (worker, i): a prompt of `tokens` words that no other request shares (its first
    words differ), so every arm hashes and forwards a new prompt each time."""
    shared = traces.words_text(random.Random(SEED), tokens)
    return lambda w, i: chat_body(f"Request {w}-{i}. {shared}", stream)


async def sequential(urls: dict[str, str], per_arm: int) -> dict[str, list[float]]:
    """TTFT samples (ms) per arm, the arms taking turns BLOCK requests at a time."""
    make = body_maker(SHORT_TOKENS, stream=True)
    ttft: dict[str, list[float]] = {label: [] for label in urls}
    async with contextlib.AsyncExitStack() as stack:
        clients = {label: await stack.enter_async_context(_client(u)) for label, u in urls.items()}
        for client in clients.values():
            for i in range(WARMUP):
                await _one(client, make(-1, i), Sample())
        for turn in range(per_arm // BLOCK):
            for label, client in clients.items():
                for i in range(BLOCK):
                    sample = Sample()
                    await _one(client, make(turn, i), sample)
                    if sample.ttft_s is not None:
                        ttft[label].append(sample.ttft_s * 1000)
    return ttft


def low_load_rows(ttft: dict[str, list[float]]) -> list[dict[str, Any]]:
    d50, d99 = percentile(ttft[DIRECT], 50), percentile(ttft[DIRECT], 99)
    rows: list[dict[str, Any]] = []
    for label, values in ttft.items():
        if label == DIRECT:
            continue
        rows.append(
            {
                "router": label,
                "n": len(values),
                "ttft_p50_ms": percentile(values, 50),
                "ttft_p99_ms": percentile(values, 99),
                "added_ttft_p50_ms": percentile(values, 50) - d50,
                "added_ttft_p99_ms": percentile(values, 99) - d99,
            }
        )
    floor = next((r for r in rows if r["router"] == FLOOR), None)
    for r in rows:
        for key in ("added_ttft_p50_ms", "added_ttft_p99_ms"):
            r[f"{key}_vs_floor"] = r[key] / floor[key] if floor and floor[key] > 0 else None
    return rows


def saturation(
    urls: dict[str, str], pids: dict[str, int | None], slice_s: float, rounds: int
) -> list[dict[str, Any]]:
    """Requests per router CPU-second per (stream, prompt tokens), arms taking turns."""
    rows: list[dict[str, Any]] = []
    for tokens in (SHORT_TOKENS, LONG_TOKENS):
        for stream in (True, False):
            make = body_maker(tokens, stream)
            # per arm: ok, errors, router CPU s, wall s, client CPU s
            totals = {label: [0.0] * 5 for label in urls}
            for _ in range(rounds):
                for label, url in urls.items():
                    before, client_before = cpu_seconds(pids[label]), time.process_time()
                    ok, err, wall = asyncio.run(closed_loop(url, slice_s, body=make))
                    t = totals[label]
                    t[0], t[1] = t[0] + ok, t[1] + err
                    t[2], t[3] = t[2] + cpu_seconds(pids[label]) - before, t[3] + wall
                    t[4] += time.process_time() - client_before
            for label, (done, failed, cpu_s, wall_s, client_s) in totals.items():
                rows.append(
                    {
                        "router": label, "prompt_tokens": tokens, "stream": stream,
                        "ok": int(done), "errors": int(failed), "requests_per_s": done / wall_s,
                        "wall_s": wall_s, "client_cpu_s": client_s,
                        "router_cpu_s": cpu_s if pids[label] else None,
                        "requests_per_cpu_s": done / cpu_s if pids[label] and cpu_s else None,
                    }
                )  # fmt: skip
    for r in rows:
        floor = next(
            (f for f in rows if f["router"] == FLOOR and f["stream"] == r["stream"]
             and f["prompt_tokens"] == r["prompt_tokens"]),
            None,
        )  # fmt: skip
        ours, theirs = r["requests_per_cpu_s"], floor and floor["requests_per_cpu_s"]
        r["per_cpu_s_vs_floor"] = ours / theirs if ours and theirs else None
    return rows


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def goals(low: list[dict[str, Any]], sat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each cachelane arm, and the routing floor, against the overhead goals (GOAL_*), as ratios
    that meet them at <= 1 (latency) and >= 1 (requests per CPU-second); None where the floor or
    vllm-router did not run. Where the routing floor misses a goal, no cache-aware router on
    this stack meets it with cachelane's routing/ code."""
    added = {r["router"]: r for r in low}
    per_cpu = {
        r["router"]: r["requests_per_cpu_s"]
        for r in sat
        if r["stream"] and r["prompt_tokens"] == SHORT_TOKENS
    }
    floor, vllm = added.get(FLOOR, {}), added.get(VLLM, {})
    rows: list[dict[str, Any]] = []
    for label, r in added.items():
        if not label.startswith("cachelane") and label != ROUTING_FLOOR:
            continue
        p50, p99 = r["added_ttft_p50_ms"], r["added_ttft_p99_ms"]
        floor_p50, floor_p99 = floor.get("added_ttft_p50_ms"), floor.get("added_ttft_p99_ms")
        floor_cpu, ours_cpu = per_cpu.get(FLOOR), per_cpu.get(label)
        rows.append(
            {
                "router": label,
                "p50_minus_floor_plus_margin_ms": (
                    p50 - (floor_p50 + GOAL_P50_MARGIN_MS) if floor_p50 is not None else None
                ),
                "p50_vs_vllm": _ratio(p50, vllm.get("added_ttft_p50_ms")),
                "p99_vs_floor_times": _ratio(p99, floor_p99 and GOAL_P99_TIMES * floor_p99),
                "per_cpu_s_vs_floor_share": _ratio(
                    ours_cpu, floor_cpu and GOAL_PER_CPU_SHARE * floor_cpu
                ),
                "per_cpu_s_vs_vllm": _ratio(ours_cpu, per_cpu.get(VLLM)),
            }
        )
    return rows


def run(console: Console, arms: Sequence[RouterSpec], quick: bool, out: Path) -> dict[str, Any]:
    log_dir = harness.log_dir(out)
    not_run: dict[str, str] = {}
    load: dict[str, tuple[float, float, float]] = {"start": os.getloadavg()}
    with zero_delay_fleet(log_dir) as replica_urls, contextlib.ExitStack() as stack:
        urls: dict[str, str] = {DIRECT: replica_urls[0]}
        pids: dict[str, int | None] = {DIRECT: None}
        for spec in arms:
            if spec.kind in ("sglang", "vllm") and harness.peer_router_error(console, spec.kind):
                not_run[spec.label] = f"{spec.kind}-router not installed"
                continue

            def start(spec: RouterSpec = spec) -> Any:
                return stack.enter_context(running_router(spec, replica_urls, log_dir))

            router = harness.try_arm(console, spec.label, not_run, start)
            if router is not None:
                urls[spec.label], pids[spec.label] = router.url, router.pid
        console.print(f"arms: {', '.join(urls)}; sequential streamed requests ...")
        per_arm = QUICK_SEQUENTIAL_PER_ARM if quick else SEQUENTIAL_PER_ARM
        low = low_load_rows(asyncio.run(sequential(urls, per_arm)))
        load["after_low_load"] = os.getloadavg()
        console.print("saturation ...")
        slice_s, rounds = (QUICK_SLICE_S, QUICK_ROUNDS) if quick else (SLICE_S, ROUNDS)
        sat = saturation(urls, pids, slice_s, rounds)
        load["end"] = os.getloadavg()
    return {
        "settings": {
            "concurrency": CONCURRENCY, "max_tokens": MAX_TOKENS, "cpus": os.cpu_count(),
            "sequential_per_arm": per_arm, "block": BLOCK, "slice_s": slice_s, "rounds": rounds,
        },
        "load_average": load, "low_load": low, "saturation": sat, "goals": goals(low, sat),
        "not_run": not_run,
    }  # fmt: skip


def _f(value: Any, digits: int = 2) -> str:
    return "-" if value is None or value != value else f"{value:,.{digits}f}"


def print_tables(console: Console, payload: dict[str, Any]) -> None:
    t = Table(title="low load: sequential streamed requests, added TTFT vs direct (ms)")
    cols: tuple[str, ...] = (
        "router",
        "n",
        "added p50",
        "added p99",
        "p50 / floor's",
        "p99 / floor's",
    )
    report.add_columns(t, cols, left=("router",))
    for r in payload["low_load"]:
        t.add_row(
            r["router"], str(r["n"]), _f(r["added_ttft_p50_ms"]), _f(r["added_ttft_p99_ms"]),
            _f(r["added_ttft_p50_ms_vs_floor"]), _f(r["added_ttft_p99_ms_vs_floor"]),
        )  # fmt: skip
    console.print(t)
    t = Table(title=f"saturation: closed loop, {CONCURRENCY} in flight")
    cols = (
        "router",
        "prompt",
        "mode",
        "req/s",
        "router CPU s",
        "client CPU s",
        "req per CPU-s",
        "/ floor's",
        "err",
    )
    report.add_columns(t, cols, left=("router", "mode"))
    for r in payload["saturation"]:
        t.add_row(
            r["router"], str(r["prompt_tokens"]), "stream" if r["stream"] else "plain",
            _f(r["requests_per_s"], 0), _f(r["router_cpu_s"]), _f(r["client_cpu_s"]),
            _f(r["requests_per_cpu_s"], 0), _f(r["per_cpu_s_vs_floor"]), str(r["errors"]),
        )  # fmt: skip
    console.print(t)
    t = Table(
        title=f"goals, streamed {SHORT_TOKENS}-token prompts: p50 - (floor's + "
        f"{GOAL_P50_MARGIN_MS}) <= 0, the ratios <= 1 (TTFT) and >= 1 (req per CPU-s)"
    )
    cols = (
        "router", "p50 - (floor + margin)", "p50 / vllm's", f"p99 / {GOAL_P99_TIMES:g}x floor's",
        f"req/CPU-s / {GOAL_PER_CPU_SHARE:g}x floor's", "req/CPU-s / vllm's",
    )  # fmt: skip
    report.add_columns(t, cols, left=("router",))
    for g in payload["goals"]:
        t.add_row(
            g["router"], _f(g["p50_minus_floor_plus_margin_ms"]), _f(g["p50_vs_vllm"]),
            _f(g["p99_vs_floor_times"]), _f(g["per_cpu_s_vs_floor_share"]),
            _f(g["per_cpu_s_vs_vllm"]),
        )  # fmt: skip
    console.print(t)
    console.print(f"load average (1, 5, 15 min): {payload['load_average']}")
    harness.print_not_run(console, payload["not_run"])


def plot(path: Path, payload: dict[str, Any]) -> None:
    plt = figures.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = payload["low_load"]
    xs = range(len(rows))
    left.bar([x - 0.2 for x in xs], [r["added_ttft_p50_ms"] for r in rows], 0.4, label="p50")
    left.bar([x + 0.2 for x in xs], [r["added_ttft_p99_ms"] for r in rows], 0.4, label="p99")
    left.set_xticks(list(xs), [r["router"] for r in rows], fontsize=7)
    left.set_ylabel("added TTFT vs direct (ms)")
    left.set_title("low load, streamed")
    left.legend()
    sat = [r for r in payload["saturation"] if r["requests_per_cpu_s"]]
    cells = sorted({(r["prompt_tokens"], r["stream"]) for r in sat})
    labels = sorted({r["router"] for r in sat})
    width = 0.8 / max(1, len(labels))
    for k, label in enumerate(labels):
        values = {(r["prompt_tokens"], r["stream"]): r["requests_per_cpu_s"] for r in sat
                  if r["router"] == label}  # fmt: skip
        right.bar([c + k * width for c in range(len(cells))],
                  [values.get(c, 0) for c in cells], width, label=label)  # fmt: skip
    right.set_xticks(
        [c + 0.4 - width / 2 for c in range(len(cells))],
        [f"{t} tok {'stream' if s else 'plain'}" for t, s in cells], fontsize=7,
    )  # fmt: skip
    right.set_ylabel("requests per router CPU-second")
    right.set_title(f"saturation, {CONCURRENCY} in flight")
    right.legend(fontsize=7)
    figures.save_figure(fig, path, dpi=100)


def main(argv: Sequence[str] | None = None) -> int:
    parser = harness.parser(
        "overhead_floor",
        "Added TTFT and requests per CPU-second of cachelane, the bare proxy (the stack's "
        "floor), vllm-router and sglang-router, arms taking turns in one run.",
        quick="a few requests per arm and short turns: checks the machinery",
    )
    harness.add_names(parser, "--arms", [a.kind for a in ARMS], "arms to run besides direct")
    parser.add_argument("--out", type=Path, default=OUT_PATH)
    parser.add_argument(
        "--baseline", metavar="GIT_REF", help="also run cachelane as it was at this commit"
    )
    parser.add_argument(
        "--workers", type=int, default=1,
        help="also run cachelane with `serve --workers N` (N > 1) beside the one-worker arm",
    )  # fmt: skip
    args = parser.parse_args(argv)
    kinds = set(args.arms.split(","))
    chosen = [a for a in ARMS if a.kind in kinds]
    if args.workers > 1 and "cachelane" in kinds:  # right after the one-worker arm
        at = next(i + 1 for i, a in enumerate(chosen) if a.kind == "cachelane")
        chosen.insert(at, with_workers(CACHELANE, args.workers))
    if args.baseline:  # beside this checkout's cachelane, before the Rust routers
        at = next((i + 1 for i, a in enumerate(chosen) if a.kind == "cachelane"), len(chosen))
        chosen.insert(at, baseline_tree(args.baseline, harness.log_dir(args.out)))
    console = harness.console(150)
    started = time.perf_counter()
    payload: dict[str, Any] = {}

    def arms() -> None:
        payload.update(run(console, chosen, args.quick, args.out))

    code = harness.run_arms(console, "overhead_floor", arms)
    if code:
        return code
    payload["wall_time_s"] = time.perf_counter() - started
    print_tables(console, payload)
    clean = report.clean_floats(payload)
    harness.write_results(
        console, args.out, payload, lambda png: plot(png, clean), payload["wall_time_s"],
        harness.log_dir(args.out),
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
