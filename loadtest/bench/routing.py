"""Routing-quality benchmark: the same seeded traces, open-loop, through every router.

    python -m loadtest.bench.routing            # every scenario, ~15 s of trace per router
    python -m loadtest.bench.routing --quick    # a few seconds each: a smoke run
    python -m loadtest.bench.routing --scenarios chat,rag \
        --routers cachelane:cache_aware,sglang:cache_aware

Routers: cachelane with each policy, sglang-router (cache_aware, round_robin, power_of_two) and
vllm-router (cache_aware, round_robin, consistent_hash), the latter two pip-installed into
.venv-routers/ on first use (a failed install or start is reported, and the run goes on).
Scenarios: the workload shapes (chat, shared_system, rag, agentic, unique) on 4 replicas with
small HBM; `tiered-low` / `tiered-high` (CPU offload tier + shared remote tier, low and high
reuse); `critical` (a voice tenant under a burst of standard traffic; cachelane with a pinned
HBM-only replica and without; the other routers, which have no such notion, on the whole fleet).

Before every run each replica's prefix cache (and the remote tier) is reset, and each router is
started fresh. Hit rate is cached / prompt tokens from the replicas' usage; per-replica request
counts come from the replicas' own vllm:generation_tokens counters (every request generates
exactly max_tokens), so they are the same measurement for every router. Writes
results/bench_routing.json and PNGs (TTFT CDF and hit rate vs ideal per scenario, and a summary).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console
from rich.table import Table

from loadtest.bench import figures, harness, report
from loadtest.bench.peer_routers import (
    CACHELANE_POLICIES,
    EXTERNAL_POLICIES,
    RouterSpec,
    running_router,
    with_workers,
)
from loadtest.bench.processes import ManagedProcess, free_port, free_port_run, wait_ready
from loadtest.bench.replay import RequestResult, Summary, replay, summarize
from loadtest.bench.report import ms
from loadtest.sim.config import ITL_S, SIM_MODEL
from loadtest.workloads import scenarios, traces
from routing.cost import PREFILL_TOKENS_PER_S
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS

OUT_PATH = Path("results/bench_routing.json")
PLOT_DIR = Path("results/bench_routing")

REPLICAS = 4
DURATION_S = 15.0
# Per router per scenario: 10 routers x 5 shapes x ~20 s (with start-up and drain) is ~17 min;
# long enough for a few hundred requests per run, so p99 is over ~3 samples or more.
QUICK_DURATION_S = 4.0
DRAIN_TIMEOUT_S = 30.0  # stragglers after the last arrival; a run never takes longer

TIME_FACTOR = 1.0  # real-time simulation, as in loadtest/demo/run.py (sleeps >> Python per request)
HBM_CAPACITY_TOKENS = 44_000
# As in loadtest/demo/run.py: the working set of a 15-25 s trace is a few times one replica's HBM
# and about the fleet's, the regime where placement decides the hit rate (run.py explains the
# number).

TIERED_HBM_TOKENS = 16_000
TIERED_CPU_TOKENS = 64_000
# Tiered fleet: HBM holds a few prompts, the CPU tier 4x more (CPU RAM is typically several times
# HBM), the remote tier everything (1 TiB default, loadtest/sim/config.py).

RATES_PER_S = {
    "chat": 12.0,
    "shared_system": 12.0,
    "rag": 15.0,
    "agentic": 8.0,
    "unique": 15.0,
    "tiered-low": 12.0,
    "tiered-high": 10.0,
}
# Offered load per scenario. 2 cores are shared by client, router and fleet: ~15 streamed req/s
# keeps Python well under both (demo/run.py). Agentic prompts grow to ~20k tokens, so fewer of them.
VOICE_RATE_PER_S = 3.0
BURST_RATE_PER_S = 22.0
# The critical scenario: a steady voice tenant, and a standard burst ~1.5x the demo's comfortable
# 15 req/s in the middle half, so replicas queue and the voice tenant's TTFT is at stake.

SERVICE_BOUND = traces.ServiceBound(
    prefill_tokens_per_s=PREFILL_TOKENS_PER_S / TIME_FACTOR / 2, itl_s=ITL_S * TIME_FACTOR * 2
)  # as demo/run.py: a turn is never sent before its previous turn could have finished

VOICE_KEY = "bench-voice-key-0123456789abcdef0123456789"
STANDARD_KEY = "bench-standard-key-0123456789abcdef0123456789"

PLAIN = ("chat", "shared_system", "rag", "agentic", "unique")
TIERED = ("tiered-low", "tiered-high")
ALL_SCENARIOS = (*PLAIN, *TIERED, "critical")


def all_router_specs() -> list[RouterSpec]:
    specs = [RouterSpec("cachelane", p) for p in CACHELANE_POLICIES]
    for kind, policies in EXTERNAL_POLICIES.items():
        specs += [RouterSpec(kind, p) for p in policies]
    return specs


SUBSET = (
    "cachelane:round_robin",
    "cachelane:cache_aware",
    "sglang:cache_aware",
    "vllm:cache_aware",
)
# Tiered and critical runs: the baseline, cachelane's policy and each other router's best.


@dataclass(frozen=True)
class FleetShape:
    replicas: int = REPLICAS
    hbm_capacity_tokens: int = HBM_CAPACITY_TOKENS
    cpu_capacity_tokens: int = 0
    remote: bool = False


@dataclass
class Fleet:
    urls: list[str]
    remote_url: str | None

    def reset(self) -> None:
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            for url in self.urls:
                client.post(f"{url}/reset_prefix_cache").raise_for_status()
            if self.remote_url:
                client.post(f"{self.remote_url}/reset").raise_for_status()

    def generation_tokens(self) -> dict[str, float]:
        """vllm:generation_tokens per replica (host:port), from each replica's /metrics."""
        out: dict[str, float] = {}
        pattern = re.compile(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", re.M)
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            for url in self.urls:
                match = pattern.search(client.get(f"{url}/metrics").text)
                out[url.removeprefix("http://")] = float(match.group(1)) if match else 0.0
        return out


@contextlib.contextmanager
def sim_fleet(shape: FleetShape, log_dir: Path) -> Iterator[Fleet]:
    port = free_port_run(shape.replicas)
    remote_port = free_port() if shape.remote else None
    args = [
        sys.executable, "-m", "loadtest.sim",
        "--replicas", str(shape.replicas), "--port", str(port),
        "--hbm-capacity-tokens", str(shape.hbm_capacity_tokens),
        "--cpu-capacity-tokens", str(shape.cpu_capacity_tokens),
        "--time-factor", str(TIME_FACTOR),
    ]  # fmt: skip
    if remote_port is not None:
        args += ["--remote-port", str(remote_port)]
    proc = ManagedProcess("sim fleet", args, log_dir / "sim.log")
    urls = [f"http://127.0.0.1:{port + i}" for i in range(shape.replicas)]
    remote_url = f"http://127.0.0.1:{remote_port}" if remote_port else None
    try:
        proc.start()
        wait_ready(
            proc, [f"{u}/health" for u in urls] + ([f"{remote_url}/health"] * bool(remote_url))
        )
        yield Fleet(urls, remote_url)
    finally:
        proc.stop()


# --- cachelane configs: the fleet's facts (capacities, tiers, tenants), no tuning -------------


def _pool(name: str, urls: Sequence[str], shape: FleetShape, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "models": [SIM_MODEL],
        "replicas": list(urls),
        "hbm_capacity_tokens": shape.hbm_capacity_tokens,
        "cpu_capacity_tokens": shape.cpu_capacity_tokens,
        **extra,
    }


def cachelane_config(
    fleet: Fleet, shape: FleetShape, *, pinned: bool | None = None
) -> dict[str, Any]:
    """pinned None: no tenants; True: voice is critical on a pinned HBM-only replica; False: the
    same tenants, voice standard, one pool (what the fleet is without the feature)."""
    data: dict[str, Any] = {"listen": {"host": "127.0.0.1", "port": 8000}}
    if shape.remote:
        data["remote_tiers"] = [{"name": "kv", "url": fleet.remote_url}]
    remote = {"remote_tier": "kv"} if shape.remote else {}
    if pinned is None:
        data["auth"] = {"mode": "open"}  # no tenants: no keys to check (keys mode fails closed)
        data["pools"] = [_pool("default", fleet.urls, shape, **remote)]
        return data
    data["tenants"] = [
        {"name": "voice", "api_key": VOICE_KEY, "class": "critical" if pinned else "standard"},
        {"name": "web", "api_key": STANDARD_KEY, "class": "standard"},
    ]
    if pinned:
        data["pools"] = [
            _pool("pinned", fleet.urls[:1], shape, pinned=True, hbm_only=True),
            _pool("shared", fleet.urls[1:], shape, **remote),
        ]
    else:
        data["pools"] = [_pool("default", fleet.urls, shape, **remote)]
    return data


# --- scenarios -------------------------------------------------------------------------------


@dataclass
class Scenario:
    name: str
    trace: list[traces.TraceRecord]
    shape: FleetShape
    routers: list[RouterSpec]
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)  # label -> cachelane config
    tenants: bool = False  # replay voice and standard records with their own API keys


def build_scenarios(
    names: Sequence[str], routers: list[RouterSpec], duration_s: float, seed: int
) -> list[Scenario]:
    subset = [r for r in routers if r.label in SUBSET] or routers
    out: list[Scenario] = []
    for name in names:
        kwargs: dict[str, Any] = {"duration_s": duration_s, "seed": seed, "bound": SERVICE_BOUND}
        if name in PLAIN:
            trace = traces.shape_trace(name, rate_per_s=RATES_PER_S[name], **kwargs)
            out.append(Scenario(name, trace, FleetShape(), list(routers)))
        elif name in TIERED:
            mix = scenarios.LOW_REUSE_MIX if name == "tiered-low" else scenarios.HIGH_REUSE_MIX
            trace = traces.generate(mix, rate_per_s=RATES_PER_S[name], **kwargs)
            shape = FleetShape(
                hbm_capacity_tokens=TIERED_HBM_TOKENS,
                cpu_capacity_tokens=TIERED_CPU_TOKENS,
                remote=True,
            )
            out.append(Scenario(name, trace, shape, subset))
        elif name == "critical":
            trace = scenarios.critical_trace(
                voice_rate_per_s=VOICE_RATE_PER_S,
                burst_rate_per_s=BURST_RATE_PER_S,
                duration_s=duration_s,
                seed=seed,
                bound=SERVICE_BOUND,
            )
            specs = [r for r in subset if r.kind != "cachelane" or r.policy == "cache_aware"]
            if any(r.label == "cachelane:cache_aware" for r in subset):
                specs.insert(1, RouterSpec("cachelane", "cache_aware", label_suffix="+pinned"))
            out.append(Scenario(name, trace, FleetShape(), specs, tenants=True))
        else:
            raise ValueError(f"unknown scenario {name!r}; known: {', '.join(ALL_SCENARIOS)}")
    return out


# --- one run ---------------------------------------------------------------------------------


@dataclass
class RunResult:
    results: list[RequestResult]
    summary: Summary
    per_replica: dict[str, int]
    by_tenant: dict[str, Summary]


async def _replay_tenants(
    trace: list[traces.TraceRecord], url: str, tenants: bool
) -> list[RequestResult]:
    if not tenants:
        return await replay(trace, url, drain_timeout_s=DRAIN_TIMEOUT_S)
    voice = [r for r in trace if r["tenant"] == scenarios.VOICE_TENANT]
    standard = [r for r in trace if r["tenant"] != scenarios.VOICE_TENANT]
    v, s = await asyncio.gather(
        replay(voice, url, api_key=VOICE_KEY, drain_timeout_s=DRAIN_TIMEOUT_S),
        replay(standard, url, api_key=STANDARD_KEY, drain_timeout_s=DRAIN_TIMEOUT_S),
    )
    return v + s


def run_one(scenario: Scenario, spec: RouterSpec, fleet: Fleet, log_dir: Path) -> RunResult:
    if spec.kind == "cachelane":
        pinned = None
        if scenario.tenants:
            pinned = spec.label_suffix == "+pinned"
        config = cachelane_config(fleet, scenario.shape, pinned=pinned)
        path = log_dir / f"cachelane-{scenario.name}{spec.label_suffix}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        scenario.configs[spec.label] = config
        spec = dataclasses.replace(spec, config=path)
    fleet.reset()
    before = fleet.generation_tokens()
    with running_router(spec, fleet.urls, log_dir) as router:
        started = time.perf_counter()
        results = asyncio.run(_replay_tenants(scenario.trace, router.url, scenario.tenants))
        elapsed_s = time.perf_counter() - started
    after = fleet.generation_tokens()
    max_tokens = scenario.trace[0]["max_tokens"]
    per_replica = {k: round((after[k] - before[k]) / max_tokens) for k in after}
    summary = summarize(results, elapsed_s)
    mean = sum(per_replica.values()) / len(per_replica) if per_replica else 0.0
    summary = dataclasses.replace(
        summary,
        per_replica=per_replica,
        max_mean_ratio=max(per_replica.values()) / mean if mean else 0.0,
    )
    by_tenant: dict[str, Summary] = {}
    if scenario.tenants:
        voice = [r for r in results if r.tenant == scenarios.VOICE_TENANT]
        standard = [r for r in results if r.tenant != scenarios.VOICE_TENANT]
        by_tenant = {
            "voice": summarize(voice, elapsed_s),
            "standard": summarize(standard, elapsed_s),
        }
    return RunResult(results, summary, per_replica, by_tenant)


# --- output ----------------------------------------------------------------------------------


def scenario_table(
    name: str, ideal: float, runs: dict[str, RunResult], failures: dict[str, str]
) -> Table:
    table = Table(title=f"{name}: ideal hit rate {ideal:.1%} (latencies in ms)")
    columns = (
        "router", "hit", "hit/ideal", "TTFT p50", "p90", "p99", "e2e p50", "e2e p99",
        "req/s", "err", "max/mean",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "router" else "right")
    others = [r.summary.ttft_p99_ms for k, r in runs.items() if not k.startswith("cachelane")]
    best_other = min((v for v in others if v == v), default=float("nan"))
    for label, run in runs.items():
        s = run.summary
        p99 = ms(s.ttft_p99_ms)
        if (
            label.startswith("cachelane")
            and best_other == best_other
            and s.ttft_p99_ms <= best_other
        ):
            p99 = f"[green]{p99}[/]"
        table.add_row(
            label,
            f"{s.hit_rate:.1%}",
            f"{s.hit_rate / ideal:.2f}" if ideal else "-",
            ms(s.ttft_p50_ms),
            ms(s.ttft_p90_ms),
            p99,
            ms(s.e2e_p50_ms),
            ms(s.e2e_p99_ms),
            f"{s.throughput_req_per_s:.1f}",
            str(s.errors),
            f"{s.max_mean_ratio:.2f}",
        )
        for tenant, ts in run.by_tenant.items():
            table.add_row(
                f"  {tenant}", f"{ts.hit_rate:.1%}", "", ms(ts.ttft_p50_ms), ms(ts.ttft_p90_ms),
                ms(ts.ttft_p99_ms), ms(ts.e2e_p50_ms), ms(ts.e2e_p99_ms), "", str(ts.errors), "",
            )  # fmt: skip
    for label, why in failures.items():
        table.add_row(label, f"[red]not run: {why[:90]}[/]", *[""] * (len(columns) - 2))
    return table


def plot_scenario(path: Path, name: str, ideal: float, runs: dict[str, RunResult]) -> None:
    plt = figures.pyplot()
    fig, (cdf_ax, bar_ax) = plt.subplots(1, 2, figsize=(13, 4.8))
    for label, run in runs.items():
        ttft = sorted(r.ttft_s * 1000 for r in run.results if r.ok and r.ttft_s is not None)
        if ttft:
            style = "-" if label.startswith("cachelane") else "--"
            fractions = [(i + 1) / len(ttft) for i in range(len(ttft))]
            cdf_ax.step(ttft, fractions, style, where="post", label=label, linewidth=1.2)
    cdf_ax.set_xscale("log")
    cdf_ax.set_xlabel("time to first token (ms, log scale)")
    cdf_ax.set_ylabel("fraction of requests")
    cdf_ax.set_title(f"{name}: TTFT CDF")
    cdf_ax.grid(True, which="both", alpha=0.3)
    cdf_ax.legend(fontsize=7)
    labels = list(runs)
    rates = [runs[k].summary.hit_rate for k in labels]
    colors = ["tab:blue" if k.startswith("cachelane") else "tab:gray" for k in labels]
    bars = bar_ax.bar(range(len(labels)), rates, color=colors)
    bar_ax.bar_label(bars, labels=[f"{r:.0%}" for r in rates], fontsize=7)
    bar_ax.axhline(ideal, color="tab:red", linestyle="--", label=f"ideal {ideal:.0%}")
    bar_ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=7)
    bar_ax.set_ylim(0, 1)
    bar_ax.set_ylabel("prefix hit rate (cached / prompt tokens)")
    bar_ax.set_title(f"{name}: hit rate vs ideal")
    bar_ax.legend(fontsize=8)
    figures.save_figure(fig, path, dpi=100)


def plot_summary(path: Path, payload: dict[str, Any]) -> None:
    """Hit rate / ideal and TTFT p99 per router, one group of bars per scenario."""
    plt = figures.pyplot()
    names = [n for n, s in payload["scenarios"].items() if s["routers"]]
    labels = sorted({k for n in names for k in payload["scenarios"][n]["routers"]})
    fig, (hit_ax, p99_ax) = plt.subplots(2, 1, figsize=(14, 8))
    width = 0.8 / max(1, len(labels))
    cmap = plt.get_cmap("tab20")
    for j, label in enumerate(labels):
        xs, hits, p99s = [], [], []
        for i, name in enumerate(names):
            s = payload["scenarios"][name]
            run = s["routers"].get(label)
            if run is None:
                continue
            xs.append(i + j * width)
            ideal = s["ideal_hit_rate"]
            hits.append(run["hit_rate"] / ideal if ideal else 0.0)
            p99s.append(run["ttft_p99_ms"] or 0.0)
        hit_ax.bar(xs, hits, width, label=label, color=cmap(j))
        p99_ax.bar(xs, p99s, width, label=label, color=cmap(j))
    centers = [i + 0.4 - width / 2 for i in range(len(names))]
    for ax in (hit_ax, p99_ax):
        ax.set_xticks(centers, names)
        ax.grid(True, axis="y", alpha=0.3)
    hit_ax.axhline(0.9, color="tab:red", linestyle="--", linewidth=1)
    hit_ax.set_ylabel("hit rate / ideal (target line 0.9)")
    p99_ax.set_ylabel("TTFT p99 (ms, log)")
    p99_ax.set_yscale("log")
    hit_ax.legend(fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, 1.25))
    figures.save_figure(fig, path, dpi=100)


# --- main ------------------------------------------------------------------------------------


def select_routers(text: str | None) -> list[RouterSpec]:
    specs = all_router_specs()
    if not text:
        return specs
    wanted = [w.strip() for w in text.split(",") if w.strip()]
    known = {s.label: s for s in specs}
    for w in wanted:  # cachelane:<policy>+2w: that policy served by `cachelane serve --workers 2`
        base, _, workers = w.partition("+")
        if base in known and base.startswith("cachelane:") and re.fullmatch(r"\d+w", workers):
            known[w] = with_workers(known[base], int(workers[:-1]))
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise ValueError(f"--routers: unknown {unknown}; known: {', '.join(known)}")
    return [known[w] for w in wanted]


def run_scenario(
    console: Console,
    scenario: Scenario,
    duration_s: float,
    log_dir: Path,
    install_errors: dict[str, str],
    plot_dir: Path,
) -> tuple[Table, dict[str, Any]]:
    """Every router of one scenario on one fleet: its table (printed), its plot and its
    section of the results."""
    ideal = traces.ideal_hits(scenario.trace).hit_rate
    runs: dict[str, RunResult] = {}
    failures: dict[str, str] = {}
    console.print(
        f"[bold]{scenario.name}[/]: {len(scenario.trace)} requests over {duration_s:.0f} s,"
        f" ideal hit rate {ideal:.1%}, {len(scenario.routers)} routers"
    )
    with sim_fleet(scenario.shape, log_dir) as fleet:
        for spec in scenario.routers:
            if spec.kind in install_errors:
                failures[spec.label] = install_errors[spec.kind]
                continue
            result = harness.try_arm(
                console,
                spec.label,
                failures,
                functools.partial(run_one, scenario, spec, fleet, log_dir),
                indent="  ",
            )
            if result is None:
                continue
            runs[spec.label] = result
            s = result.summary
            console.print(
                f"  {spec.label:<26} hit {s.hit_rate:6.1%}"
                f"  TTFT p50 {ms(s.ttft_p50_ms):>6} p99 {ms(s.ttft_p99_ms):>6} ms"
                f"  errors {s.errors}"
                f"  max/mean {s.max_mean_ratio:.2f}"
            )
    table = scenario_table(scenario.name, ideal, runs, failures)
    console.print(table)
    if runs:
        plot_scenario(plot_dir / f"{scenario.name}.png", scenario.name, ideal, runs)
    return table, {
        "requests": len(scenario.trace),
        "ideal_hit_rate": ideal,
        "fleet": dataclasses.asdict(scenario.shape),
        "routers": {k: r.summary.to_dict() for k, r in runs.items()},
        "by_tenant": {
            k: {t: s.to_dict() for t, s in r.by_tenant.items()}
            for k, r in runs.items()
            if r.by_tenant
        },
        "not_run": failures,
        "cachelane_configs": scenario.configs,
    }


def run(args: argparse.Namespace) -> int:
    console = Console(width=160)
    duration_s = QUICK_DURATION_S if args.quick else args.duration_s
    try:
        routers = select_routers(args.routers)
        names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
        built = build_scenarios(names, routers, duration_s, args.seed)
    except ValueError as err:
        console.print(f"[red]bench_routing: {err}")
        return 2
    log_dir: Path = args.plot_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    install_errors: dict[str, str] = {}
    for kind in sorted({r.kind for r in routers} - {"cachelane"}):
        error = harness.peer_router_error(console, kind)
        if error:
            install_errors[kind] = error

    started = time.perf_counter()
    payload: dict[str, Any] = {
        "settings": {
            "duration_s": duration_s,
            "seed": args.seed,
            "replicas": REPLICAS,
            "time_factor": TIME_FACTOR,
            "hbm_capacity_tokens": HBM_CAPACITY_TOKENS,
            "tiered_hbm_capacity_tokens": TIERED_HBM_TOKENS,
            "tiered_cpu_capacity_tokens": TIERED_CPU_TOKENS,
            "rates_per_s": RATES_PER_S,
            "voice_rate_per_s": VOICE_RATE_PER_S,
            "burst_rate_per_s": BURST_RATE_PER_S,
            "block_size_tokens": DEFAULT_BLOCK_SIZE_TOKENS,
            "max_tokens": traces.MAX_TOKENS,
        },
        "scenarios": {},
    }
    tables: list[Table] = []
    try:
        for scenario in built:
            table, payload["scenarios"][scenario.name] = run_scenario(
                console, scenario, duration_s, log_dir, install_errors, args.plot_dir
            )
            tables.append(table)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; every process was stopped")
        return harness.INTERRUPTED

    payload["wall_time_s"] = time.perf_counter() - started
    report.write_json(args.out, payload)
    plot_summary(args.plot_dir / "summary.png", report.clean_floats(payload))
    console.rule("all scenarios")
    for table in tables:
        console.print(table)
    console.print(
        f"wrote {args.out} and PNGs in {args.plot_dir}/ in {payload['wall_time_s']:.0f} s"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = harness.parser(
        "routing",
        "Replay seeded traces open-loop through cachelane (each policy), sglang-router "
        "and vllm-router on a simulated fleet; print hit rate vs ideal, TTFT, balance.",
        quick=f"{QUICK_DURATION_S:.0f} s per run",
    )
    parser.add_argument("--duration-s", type=float, default=DURATION_S, help="trace length per run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--scenarios", default=",".join(ALL_SCENARIOS), help="comma-separated (default: all)"
    )
    parser.add_argument(
        "--routers", default=None, help="comma-separated labels, e.g. cachelane:cache_aware"
    )
    parser.add_argument("--out", type=Path, default=OUT_PATH)
    parser.add_argument("--plot-dir", type=Path, default=PLOT_DIR)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
