"""Latency-critical tenants on a busy heterogeneous fleet, against each request's own floor.

    python -m loadtest.bench.critical [--quick] [--arms no-tenants,priority,pinned,control,...]
        [--engine default|threshold|serial | --engines [LIST]] [--seeds 1,2,3]
        [--duration-s N] [--warmup-s N]

One simulated fleet of 6 replicas (2 HBM-only; 4 with a CPU offload tier and one shared remote
tier) per engine, one seeded trace of four tenants per seed (loadtest/workloads/critical_traces.py:
a voice and an agent tenant, latency-critical, carrying about half of the prompt tokens; a
chat+RAG tenant and a bulk one-off tenant, standard) at ~0.9 of the fleet's prefill under round
robin. Every arm replays the whole trace open-loop, each request with its tenant's API key, on
sims started for it (every cache and the remote tier empty), through a fresh router:

  no-tenants  cachelane, no tenants: every request is alike; the fleet's two kinds of replica as
              two unpinned pools; flow control off.
  priority    cachelane, tenants with classes, no pinned pool: the pools of no-tenants, flow
              control at its defaults, critical.clear_while_loading.
  pinned      cachelane, tenants with classes, the HBM-only replicas a pinned pool with default
              knobs: nothing but `pinned: true` (and the fleet's facts) on it.
  control     no-tenants again, after the other cachelane arms: its ratios to no-tenants are the
              run's own noise, the spread a goal ratio needs to clear.
  sglang      sglang-router and vllm-router, cache_aware, on the same 6 replicas (they ignore the
  vllm        API keys).

Engines (ENGINES; the sim's flags, loadtest/sim/fleet.py): `default`, vLLM V1's step loop with
vLLM's defaults scaled to the fleet's prefill rate (loadtest/sim/steps.py); `threshold`, the same
with a long-prefill token threshold; `serial`, one whole prefill at a time (the engine model of
earlier measurements); `fcfs`, `default` on vLLM's default `--scheduling-policy fcfs`. The others
run `--scheduling-policy priority`. Every cachelane arm's pools declare the engines' flags
(`engine:`; `priority` sends each request's class as its engine priority).

Before the arms it prints the trace's floor on the engine: each request's own prefill with a
perfect cache and no queue, in the steps it takes alone (critical_traces.ideal_floor), which no
router beats. Per arm and class (critical_results.py): TTFT p50/p90/p99, excess over the floor
p50/p90/p99, the floor, SLO attainment, hit rate, shed with Retry-After, failed; per run, the
goal ratios (critical_results.GOALS). Writes results/bench_critical.json and
results/bench_critical.png. Compare arms within one run: the machine's cores are shared by the
client, the router and the fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from loadtest.bench import critical_report, harness, report
from loadtest.bench.critical_fleet import (
    COSTS,
    CPU_TOKENS,
    ENGINES,
    GATEWAY_FAMILIES,
    HBM_ONLY_REPLICAS,
    HBM_TOKENS,
    HTTP_TIMEOUT_S,
    OFFLOAD_REPLICAS,
    PREFILL_TOKENS_PER_S,
    THRESHOLD_TOKENS,
    Engine,
    Fleet,
    placement,
    pool_stats,
    scrape,
    sim_snapshot,
)
from loadtest.bench.critical_report import Run
from loadtest.bench.critical_results import ArmResult, CriticalResult
from loadtest.bench.peer_routers import RouterSpec, running_router
from loadtest.bench.processes import (
    gateway_from_config,
    loopback_urls,
    sim_from_config,
)
from loadtest.bench.replay import (
    at_offsets,
    errors_into,
    open_client,
    request_body,
    stream_into,
)
from loadtest.bench.report import ms
from loadtest.sim.config import ITL_S, SIM_MODEL
from loadtest.workloads import critical_traces as ct
from loadtest.workloads.traces import ServiceBound, TraceRecord

# --- the run ---------------------------------------------------------------------------------

DURATION_S = 30.0
QUICK_DURATION_S = 5.0
WARMUP_S = 10.0
QUICK_WARMUP_S = 2.0
# The first seconds of every arm are replayed but not counted: the caches start empty, so the
# first request of each agent tool prompt (1.5-2.5k tokens) is a cold prefill that no router can
# avoid. In a 30 s window those four cold starts were the critical class's p99 (the floor's
# critical p99 was 466 ms with them, 215 ms after a 5 s warm-up, seed 1). A fleet in service runs
# warm; the benchmark measures that regime, and the floor is computed over the same window.
REQUEST_TIMEOUT_S = 20.0
# Every request, from send to its last byte: 20 s is ~20x the fleet's TTFT p50 here; past it the
# request is cancelled and counted as failed. After the last arrival an arm waits at most this
# long, so an arm takes at most duration + 20 s (+ a few s to start its router).
MAX_CONNECTIONS = 1024

SERVICE_BOUND = ServiceBound(prefill_tokens_per_s=PREFILL_TOKENS_PER_S / 2, itl_s=ITL_S * 2)
# The next turn of a session is never sent before its previous turn could have finished at half
# the replica's speed (as bench_routing does with its fleet).

CACHELANE_ARMS = ("no-tenants", "priority", "pinned", "control")
EXTERNAL_ARMS = {
    "sglang": RouterSpec("sglang", "cache_aware"),
    "vllm": RouterSpec("vllm", "cache_aware"),
}
# vllm-router's policies in loadtest/bench/peer_routers.py: cache_aware, round_robin,
# consistent_hash.
ARMS = (*CACHELANE_ARMS, *EXTERNAL_ARMS)


def _pool(name: str, urls: Sequence[str], *, offload: bool, **extra: Any) -> dict[str, Any]:
    pool: dict[str, Any] = {
        "name": name,
        "replicas": list(urls),
        "models": [SIM_MODEL],
        "hbm_capacity_tokens": HBM_TOKENS,
        "cpu_capacity_tokens": CPU_TOKENS if offload else 0,
        "costs": dict(COSTS),
    }
    if offload:
        pool["remote_tier"] = "kv"
    return {**pool, **extra}


def sim_config(fleet: Fleet, engine: Engine) -> dict[str, Any]:
    """The fleet as `python -m loadtest.sim --config` reads it (a gateway config's pools)."""
    sim = {"sim": {"scheduling_policy": engine.scheduling_policy}}  # the sim takes it from here
    return {
        "remote_tiers": [{"name": "kv", "url": fleet.remote}],
        "pools": [
            _pool("hbm-only", fleet.hbm_only, offload=False, hbm_only=True, **sim),
            _pool("offload", fleet.offload, offload=True, **sim),
        ],
    }


def tenants_config() -> list[dict[str, str]]:
    return [
        {"name": t.name, "api_key": t.api_key, "class": t.tenant_class} for t in ct.TENANTS.values()
    ]


def gateway_config(fleet: Fleet, arm: str, engine: Engine = ENGINES["default"]) -> dict[str, Any]:
    """Each arm's cachelane config: the fleet's facts, tenants and pools; defaults otherwise.
    Every arm declares the engines' flags (`engine:`, Engine.pool_engine: with `--declare
    policy` the policy alone), facts of the fleet like its capacities, as docs/critical.md's
    set-up does: with `priority` the pools send each request's class as its priority
    (gateway/config/pools.py engine_priority; without tenants every request is standard)."""
    tiers = [{"name": "kv", "url": fleet.remote}]
    declared = {"engine": engine.pool_engine()}
    if arm == "pinned":  # default knobs: nothing but pinned: true and the tenants' classes
        return {
            "tenants": tenants_config(),
            "remote_tiers": tiers,
            "pools": [
                _pool(
                    "pinned", fleet.hbm_only, offload=False, pinned=True, hbm_only=True, **declared
                ),
                _pool("offload", fleet.offload, offload=True, **declared),
            ],
        }
    if arm == "control":
        return gateway_config(fleet, "no-tenants", engine)
    pools = [
        _pool("hbm-only", fleet.hbm_only, offload=False, hbm_only=True, **declared),
        _pool("offload", fleet.offload, offload=True, **declared),
    ]
    if arm != "priority":
        return {"remote_tiers": tiers, "flow_control": {"enabled": False}, "pools": pools}
    return {
        "tenants": tenants_config(),
        "critical": {"clear_while_loading": True},
        "remote_tiers": tiers,
        "pools": pools,
    }


def fleet_on_free_ports() -> Fleet:
    urls = loopback_urls(1 + HBM_ONLY_REPLICAS + OFFLOAD_REPLICAS)
    return Fleet(urls[1 : 1 + HBM_ONLY_REPLICAS], urls[1 + HBM_ONLY_REPLICAS :], urls[0])


# --- replay ----------------------------------------------------------------------------------


async def _send(client: httpx.AsyncClient, record: TraceRecord, result: CriticalResult) -> None:
    def read_headers(resp: httpx.Response) -> None:
        result.fallback = resp.headers.get("x-cachelane-fallback", "")
        est = resp.headers.get("x-cachelane-est-ttft-ms")
        result.est_ttft_ms = float(est) if est else None
        if resp.status_code != 200:
            result.retry_after = resp.headers.get("retry-after")

    key = ct.TENANTS[record["tenant"]].api_key
    await stream_into(
        client,
        record,
        request_body(record, SIM_MODEL),
        result,
        headers={"authorization": f"Bearer {key}"},
        on_headers=read_headers,
    )


async def replay_trace(
    trace: Sequence[TraceRecord], base_url: str, request_timeout_s: float = REQUEST_TIMEOUT_S
) -> list[CriticalResult]:
    """Open loop: every record at its offset with its tenant's key; each bounded in time."""
    results = [
        CriticalResult(
            i,
            r["tenant"],
            r["endpoint"],
            r["t_s"],
            tenant_class=ct.TENANTS[r["tenant"]].tenant_class,
        )
        for i, r in enumerate(trace)
    ]
    timeout = httpx.Timeout(request_timeout_s, connect=HTTP_TIMEOUT_S)
    async with open_client(base_url, MAX_CONNECTIONS, timeout, trust_env=False) as client:
        loop = asyncio.get_running_loop()

        async def one(i: int, record: TraceRecord, due_s: float) -> None:
            result = results[i]
            result.send_lag_s = max(0.0, loop.time() - due_s)
            with errors_into(result, "cancelled at the arm's deadline"):
                try:
                    async with asyncio.timeout(request_timeout_s):
                        await _send(client, record, result)
                except TimeoutError:
                    result.error = f"timed out after {request_timeout_s:.0f} s"

        await at_offsets(trace, one, drain_timeout_s=request_timeout_s + 5.0)
    return results


# --- one arm ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmRun:
    """What every arm of one run shares: the fleet, the trace, its floor, where logs go."""

    fleet: Fleet
    trace: Sequence[TraceRecord]
    floor: ct.Floor
    log_dir: Path
    warmup_s: float
    tag: str  # names the arm's config and log files: seed and engine
    engine: Engine  # how the replicas schedule, as the cachelane arms declare it


@contextmanager
def sims_for_arm(arm: str, run: ArmRun) -> Iterator[None]:
    """The fleet's sims, started for one arm on the run's ports: every cache and the remote tier
    empty, and nothing an earlier arm left in their process (its heap, its connections), which
    emptying the caches would not clear, so an arm's figures do not depend on the arms before
    it. (~1 s a start.)"""
    config = sim_config(run.fleet, run.engine)
    name = f"critical-{run.tag}-{arm}"
    with sim_from_config(config, run.log_dir, name, run.engine.sim_args()):
        yield


def run_arm(arm: str, run: ArmRun) -> ArmResult:
    with sims_for_arm(arm, run):
        return _replay_arm(arm, run)


def _replay_arm(arm: str, run: ArmRun) -> ArmResult:
    fleet = run.fleet
    before = sim_snapshot(fleet)
    config: dict[str, Any] | None = None
    gateway: dict[str, float] = {}
    if arm in CACHELANE_ARMS:
        config = gateway_config(fleet, arm, run.engine)
        with gateway_from_config(config, run.log_dir, f"{arm}-{run.tag}") as gw:
            started = time.perf_counter()
            results = asyncio.run(replay_trace(run.trace, gw.url))
            elapsed = time.perf_counter() - started
            gateway = scrape(gw.url, GATEWAY_FAMILIES)
    else:
        with running_router(EXTERNAL_ARMS[arm], fleet.replicas, run.log_dir) as router:
            started = time.perf_counter()
            results = asyncio.run(replay_trace(run.trace, router.url))
            elapsed = time.perf_counter() - started
    pools = pool_stats(fleet, before, sim_snapshot(fleet), elapsed)
    return ArmResult(
        arm,
        elapsed,
        results,
        pools,
        run.floor.per_request,
        gateway,
        config,
        run.warmup_s,
    )


def run_one(console: Console, arm: str, run: ArmRun, into: Run) -> None:
    """Run one arm into `into`, or say in its `not_run` why it did not run; print its line."""
    result = harness.try_arm(console, arm, into.not_run, lambda: run_arm(arm, run))
    if result is None:
        return
    into.arms[arm] = result
    report.write_results_jsonl(run.log_dir / f"{arm}-{run.tag}-requests.jsonl", result.results)
    crit, every = result.stats("critical"), result.stats("all")
    console.print(
        f"  {arm:<11} critical TTFT p50 {ms(crit['ttft_p50_ms']):>6} p99 "
        f"{ms(crit['ttft_p99_ms']):>6} excess p99 {ms(crit['excess_p99_ms']):>6} ms  all p99 "
        f"{ms(every['ttft_p99_ms']):>6} ms  shed {every['shed']}  failed {every['failed']}"
        f"  ({result.elapsed_s:.0f} s)"
    )


# --- main ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = harness.parser(
        "critical",
        "Latency-critical tenants on a busy heterogeneous simulated fleet, against each "
        "request's own floor: cachelane without tenants, with tenants and engine priority, with "
        "a pinned pool at default knobs; sglang-router and vllm-router; per engine model.",
        quick=f"{QUICK_DURATION_S:.0f} s per arm",
    )
    add = p.add_argument
    harness.add_names(p, "--arms", ARMS, "comma-separated")
    add(
        "--engine",
        choices=list(ENGINES),
        default="default",
        help="default: vLLM V1's step loop, vLLM's defaults scaled; threshold: the same with "
        f"--long-prefill-token-threshold {THRESHOLD_TOKENS}; serial: one whole prefill at a "
        "time; fcfs: default with --scheduling-policy fcfs (default: %(default)s)",
    )
    add(
        "--engines",
        nargs="?",
        const=",".join(ENGINES),
        default=None,
        help="several engines, one after the other (comma-separated; bare: all of "
        f"{','.join(ENGINES)}); overrides --engine",
    )
    add(
        "--declare",
        choices=["flags", "policy"],
        default="flags",
        help="what the cachelane arms' pools declare of the engines: every flag they run "
        "(docs/critical.md's set-up), or the scheduling policy alone, the cost model then "
        "taking vLLM's defaults for the rest (default: %(default)s)",
    )
    add(
        "--seeds",
        default=None,
        help="comma-separated trace seeds, each a run of every engine and arm, e.g. 1,2,3 "
        "(default: --seed alone)",
    )
    add(
        "--duration-s",
        type=float,
        default=None,
        help=f"measured trace length after the warm-up (default {DURATION_S:.0f})",
    )
    add(
        "--warmup-s",
        type=float,
        default=None,
        help=f"replayed first, not counted (default {WARMUP_S:.0f}; --quick {QUICK_WARMUP_S:.0f})",
    )
    harness.add_seed_and_out(p, Path("results/bench_critical.json"))
    return p


def _source_state() -> dict[str, Any]:
    """The commit, and files of gateway/ and routing/ changed from it: other work may be in
    progress in the tree a run measures."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", "gateway", "routing"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, "changed": [line[3:] for line in changed]}


def describe_trace(
    console: Console, trace: Sequence[TraceRecord], seed: int, warmup_s: float, total_s: float
) -> dict[str, Any]:
    """Print what the trace asks of the fleet; return it for the JSON."""
    shapes = [ct.ReplicaShape(HBM_TOKENS, 0, False, PREFILL_TOKENS_PER_S)] * HBM_ONLY_REPLICAS
    shapes += [ct.ReplicaShape(HBM_TOKENS, CPU_TOKENS, True, PREFILL_TOKENS_PER_S)] * (
        OFFLOAD_REPLICAS
    )
    load = ct.round_robin_load(trace, shapes, total_s, model=SIM_MODEL)
    console.print(
        f"seed {seed}: {len(trace)} requests over {total_s:.0f} s ({len(trace) / total_s:.1f}/s; "
        f"the first {warmup_s:.0f} s warm the caches and are not counted): "
        + ", ".join(f"{t} {n}" for t, n in sorted(load.requests.items()))
        + f"; critical tenants carry {load.critical_token_share:.0%} of "
        f"{load.total_prompt_tokens:,} prompt tokens\n"
        f"estimated prefill utilisation of the fleet ({len(shapes)} x "
        f"{PREFILL_TOKENS_PER_S:,.0f} tokens/s): {load.rr_utilisation:.2f} under round robin "
        f"(HBM/CPU/remote reuse as the simulator keeps it), {load.raw_utilisation:.2f} without "
        "any cache"
    )
    return {
        "requests": len(trace),
        "measured_requests": sum(1 for r in trace if r["t_s"] >= warmup_s),
        "load": load.to_dict(),
    }


def print_floor(console: Console, floor: ct.Floor, engine: Engine) -> None:
    console.print(
        f"engine {engine.name} {engine.to_dict()}\n  floor (perfect cache, no queue, the "
        "prefill's own steps alone; no router beats it): TTFT p50 / p99 "
        + ", ".join(
            f"{g} {ms(floor.p(g, 50))} / {ms(floor.p(g, 99))} ms" for g in (*ct.CLASSES, "all")
        )
    )


def settings(
    duration_s: float,
    warmup_s: float,
    engines: Sequence[Engine],
    traces: Mapping[int, Any],
    source: Mapping[str, Any],
) -> dict[str, Any]:
    return {
        "duration_s": duration_s,
        "warmup_s": warmup_s,
        "seeds": {str(seed): info for seed, info in traces.items()},
        "rates_per_s": ct.Mix().rates_per_s,
        "tenants": {t.name: t.tenant_class for t in ct.TENANTS.values()},
        "fleet": {
            "hbm_only_replicas": HBM_ONLY_REPLICAS,
            "offload_replicas": OFFLOAD_REPLICAS,
            "hbm_capacity_tokens": HBM_TOKENS,
            "cpu_capacity_tokens_offload": CPU_TOKENS,
            "costs": COSTS,
            "itl_s": ITL_S,
        },
        "engines": {e.name: e.to_dict() for e in engines},
        "request_timeout_s": REQUEST_TIMEOUT_S,
        "source": source,
    }


def _choices(args: argparse.Namespace) -> tuple[list[str], list[Engine], list[int]]:
    """The arms, engines and seeds asked for; ValueError on an unknown one."""
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise ValueError(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    names = [e.strip() for e in (args.engines or args.engine).split(",") if e.strip()]
    if not names or any(n not in ENGINES for n in names):
        raise ValueError(f"unknown engines in {names}; known: {', '.join(ENGINES)}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()] if args.seeds else [args.seed]
    declared = args.declare == "flags"
    engines = [replace(ENGINES[n], flags_declared=declared) for n in names]
    return arms, engines, seeds


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = harness.console(width=170)
    try:
        arms, engines, seeds = _choices(args)
    except ValueError as err:
        console.print(f"[red]bench_critical: {err}")
        return 2
    duration_s = args.duration_s or (QUICK_DURATION_S if args.quick else DURATION_S)
    warmup_s = (
        args.warmup_s if args.warmup_s is not None else (QUICK_WARMUP_S if args.quick else WARMUP_S)
    )
    total_s = warmup_s + duration_s
    out: Path = args.out
    log_dir = harness.log_dir(out)

    peers_missing: dict[str, str] = {}
    for arm in arms:
        if arm in EXTERNAL_ARMS:
            error = harness.peer_router_error(console, EXTERNAL_ARMS[arm].kind)
            if error:
                peers_missing[arm] = error

    source = _source_state()  # the tree measured, before it may change during the run
    started = time.perf_counter()
    runs: list[Run] = []
    traces: dict[int, Any] = {}
    placements: dict[str, dict[str, Any]] = {}

    def run_all() -> None:
        for seed in seeds:
            trace = ct.critical_trace(ct.Mix(), total_s, seed, SERVICE_BOUND)
            traces[seed] = describe_trace(console, trace, seed, warmup_s, total_s)
            for engine in engines:
                floor = ct.ideal_floor(
                    trace,
                    PREFILL_TOKENS_PER_S,
                    model=SIM_MODEL,
                    since_s=warmup_s,
                    steps=engine.step_settings(),
                )
                print_floor(console, floor, engine)
                run = Run(seed, engine.name, floor, not_run=dict(peers_missing))
                runs.append(run)
                fleet = fleet_on_free_ports()
                tag = f"{engine.name}-s{seed}"
                arm_run = ArmRun(fleet, trace, floor, log_dir, warmup_s, tag, engine)
                for arm in arms:
                    if arm not in run.not_run:
                        run_one(console, arm, arm_run, run)
                placements[run.label] = {n: placement(a, fleet) for n, a in run.arms.items()}
                console.print(critical_report.run_table(run))

    # an arm whose sims or router did not start is caught by harness.try_arm (its not_run)
    code = harness.run_arms(console, "bench_critical", run_all)
    if code:
        return code
    wall_s = time.perf_counter() - started
    pooled = critical_report.pooled_runs(runs)
    console.print(critical_report.ratios_table([*runs, *pooled]))
    payload = {
        "settings": settings(duration_s, warmup_s, engines, traces, source),
        "runs": critical_report.runs_payload(runs, placements),
        "pooled_goal_ratios": {run.label: run.ratios() for run in pooled},
        "wall_time_s": wall_s,
    }
    title = (
        f"latency-critical tenants, {duration_s:.0f} s per arm after a {warmup_s:.0f} s warm-up, "
        f"seeds {','.join(map(str, seeds))} (simulated fleet)"
    )
    harness.write_results(
        console, out, payload, lambda png: critical_report.plot(png, runs, title), wall_s, log_dir
    )
    missing = any(a in run.not_run for run in runs for a in CACHELANE_ARMS if a in arms)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
