"""`cachelane demo`: one seeded trace, replayed through the gateway once per routing policy.

Steps: start a simulated fleet once; generate one `mixed` trace; then for each policy reset every
replica's prefix cache, start a gateway with that policy, replay the trace open-loop, stop the
gateway. Finally print the comparison and write demo.json, demo.png, the trace and per-request
results under --out-dir. Nothing in the gateway is tuned for the demo: it runs with
`cachelane serve --replicas ... --policy P` defaults; the simulator runs with routing/cost.py's
constants, except the HBM capacity and time factor set below.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loadtest.bench import harness, report
from loadtest.bench.processes import (
    SimFleet,
    SimFleetSettings,
    gateway,
    sim_fleet,
)
from loadtest.bench.replay import RequestResult, Summary, replay, summarize
from loadtest.sim.config import ITL_S
from loadtest.workloads import traces
from routing.cost import PREFILL_TOKENS_PER_S
from routing.decide import Policy
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS

DURATION_S = 25.0
# Two policies x 25 s of arrivals, plus start-up and drain, stays under 2 minutes.

RATE_PER_S = 15.0
# Offered load. Gateway, fleet and client share 2 cores here; at ~15 req/s of streamed requests
# they use well under both cores, so what is measured is the simulated GPUs, not Python.

REPLICAS = 4

TIME_FACTOR = 1.0
# Real-time simulation: the trace's prompts are 1-10k tokens, so at 30k prefill tokens/s
# (routing/cost.py) an uncached prompt sleeps 30-330 ms in prefill, and 24 output tokens at 10 ms
# (loadtest/sim/config.py) sleep 240 ms: both far above the ~1-3 ms of Python per request.

HBM_CAPACITY_TOKENS = 44_000
# Per replica. Mid-trace ~25 sessions are alive with 100-130k tokens of context between them, plus
# ~20k tokens of system and tool prompts and ~40k of the documents in use (measured on seed 1):
# ~190k tokens, about what the whole fleet holds (4 x 44k = 176k) and 4x one replica. That is
# the regime where placement matters: round robin asks every replica to hold everything and keeps
# evicting; keeping a session where its prefix is lets the fleet hold it once. A real H200 holds
# ~800k tokens (routing/cost.py HBM_CAPACITY_TOKENS) for a proportionally larger working set.
# Measured here (seeds 1, 3, 4): 40k gives cache_aware/round_robin hit rate x2.05-2.10 but TTFT
# p99 only x0.83-0.93; 48k gives x1.94-2.31; 44k gave x2.05-2.16 with TTFT p99 x0.56-0.79.

DEFAULT_POLICIES = f"{Policy.ROUND_ROBIN.value},{Policy.CACHE_AWARE.value}"

# The workload's spacing of turns assumes at worst half the simulated speed (queueing): a turn is
# never sent before the previous one of its session could have finished.
SERVICE_BOUND = traces.ServiceBound(
    prefill_tokens_per_s=PREFILL_TOKENS_PER_S / TIME_FACTOR / 2,
    itl_s=ITL_S * TIME_FACTOR * 2,
)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Start a simulated GPU fleet, generate one seeded mixed trace (chat, agents, RAG, one-off "
        "prompts, one shared system prompt), and replay it through the gateway once per routing "
        "policy. Prints a comparison and writes demo.json and demo.png to --out-dir."
    )
    add = parser.add_argument
    add("--duration-s", type=float, default=DURATION_S, help="trace length (default: %(default)s)")
    add("--rate", type=float, default=RATE_PER_S, help="arrivals per second (default: %(default)s)")
    add("--replicas", type=int, default=REPLICAS, help="simulated replicas (default: %(default)s)")
    add("--seed", type=int, default=1, help="trace seed (default: %(default)s)")
    add("--out-dir", type=Path, default=Path("results/demo"), help="(default: %(default)s)")
    add(
        "--policies",
        default=DEFAULT_POLICIES,
        help="comma-separated routing policies to compare, in order (default: %(default)s)",
    )
    add(
        "--port",
        type=int,
        help="the simulated replicas listen on PORT, PORT+1, ... and the gateway on the port "
        "after them (default: free ports; the tier section always takes free ports)",
    )
    add(
        "--skip-tiers",
        action="store_true",
        help="skip the second section (critical tenant pinned vs unpinned, reuse-aware remote "
        "writes vs write-all), which writes demo-tiers.png",
    )


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    known = {p.value for p in Policy}
    unknown = [p for p in names if p not in known]
    if unknown or not names:
        raise ValueError(f"--policies: unknown {unknown}; choose from {sorted(known)}")
    return names


def _run_policy(
    console: Console,
    fleet: SimFleet,
    policy: str,
    trace: list[traces.TraceRecord],
    out_dir: Path,
    port: int | None,
) -> tuple[list[RequestResult], float, str]:
    fleet.reset_caches()
    pool = {"hbm_capacity_tokens": HBM_CAPACITY_TOKENS}
    with gateway(fleet.urls, policy, out_dir, pool=pool, port=port) as gw:
        columns = (
            TextColumn(f"[bold]{policy:>14}[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("hit {task.fields[hit]}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task(policy, total=len(trace), hit="-")
            tokens = {"prompt": 0, "cached": 0}

            def on_result(r: RequestResult) -> None:
                tokens["prompt"] += r.prompt_tokens
                tokens["cached"] += r.cached_tokens
                hit = f"{tokens['cached'] / tokens['prompt']:.0%}" if tokens["prompt"] else "-"
                progress.update(task, advance=1, hit=hit)

            started = time.perf_counter()
            results = asyncio.run(replay(trace, gw.url, on_result=on_result))
            return results, time.perf_counter() - started, gw.url


def run_demo(args: argparse.Namespace) -> int:
    console = Console()
    if not console.is_terminal:  # piped or captured: no width to detect, avoid wrapping at 80
        console = Console(width=120)
    try:
        policies = _policies(args.policies)
    except ValueError as err:
        console.print(f"[red]cachelane demo: {err}")
        return 2
    started = time.perf_counter()
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)

    trace = traces.mixed(
        rate_per_s=args.rate, duration_s=args.duration_s, seed=args.seed, bound=SERVICE_BOUND
    )
    traces.write_trace(trace, out_dir / "trace.jsonl")
    ideal = traces.ideal_hits(trace, DEFAULT_BLOCK_SIZE_TOKENS)
    settings = SimFleetSettings(
        replicas=args.replicas, hbm_capacity_tokens=HBM_CAPACITY_TOKENS, time_factor=TIME_FACTOR
    )
    console.print(
        f"trace: {len(trace)} requests over {args.duration_s:.0f} s (seed {args.seed}), "
        f"{ideal.prompt_tokens:,} prompt tokens; ideal prefix hit rate {ideal.hit_rate:.1%}\n"
        f"fleet: {settings.replicas} simulated replicas, {settings.hbm_capacity_tokens:,} tokens "
        f"of HBM each, time factor {settings.time_factor}; logs in {out_dir}/"
    )

    summaries: dict[str, Summary] = {}
    results: dict[str, list[RequestResult]] = {}
    tiers: dict[str, Any] = {}

    urls: dict[str, Any] = {}
    gateway_port = None if args.port is None else args.port + args.replicas

    def run_arms() -> None:
        with sim_fleet(settings, out_dir, port=args.port) as fleet:
            names = [u.removeprefix("http://") for u in fleet.urls]
            urls["replicas"] = fleet.urls
            for policy in policies:
                rs, replay_s, urls["gateway"] = _run_policy(
                    console, fleet, policy, trace, out_dir, gateway_port
                )
                results[policy] = rs
                summaries[policy] = summarize(rs, replay_s, names)
                report.write_results_jsonl(out_dir / f"requests-{policy}.jsonl", rs)
        report.print_comparison(console, summaries, ideal.hit_rate)
        report.plot(out_dir / "demo.png", results, summaries, ideal.hit_rate)
        if not args.skip_tiers:
            from loadtest.demo.tier_section import run_tiers_section

            tiers.update(run_tiers_section(console, out_dir, args.seed))

    code = harness.run_arms(console, "cachelane demo", run_arms)
    if code:
        return code
    wall_s = time.perf_counter() - started
    payload = _payload(args, settings, trace, ideal, summaries, wall_s) | {"urls": urls}
    if not args.skip_tiers:
        payload["tiers"] = tiers
    report.write_json(out_dir / "demo.json", payload)
    pngs = "demo.png" + ("" if args.skip_tiers else " and demo-tiers.png")
    console.print(f"wrote {out_dir / 'demo.json'} and {pngs} in {wall_s:.0f} s")
    return 0


def _payload(
    args: argparse.Namespace,
    settings: SimFleetSettings,
    trace: list[traces.TraceRecord],
    ideal: traces.IdealHits,
    summaries: dict[str, Summary],
    wall_s: float,
) -> dict[str, Any]:
    return {
        "settings": {
            "duration_s": args.duration_s,
            "rate_per_s": args.rate,
            "seed": args.seed,
            "replicas": settings.replicas,
            "hbm_capacity_tokens": settings.hbm_capacity_tokens,
            "time_factor": settings.time_factor,
            "block_size_tokens": DEFAULT_BLOCK_SIZE_TOKENS,
            "max_tokens": traces.MAX_TOKENS,
        },
        "trace": {
            "requests": len(trace),
            "prompt_tokens": ideal.prompt_tokens,
            "ideal_hit_rate": ideal.hit_rate,
        },
        "policies": {p: s.to_dict() for p, s in summaries.items()},
        "ratios": report.ratios(summaries),
        "wall_time_s": wall_s,
    }
