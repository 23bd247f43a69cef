"""A family of (trace, fleet, load) members, every router on each: does a default hold on traffic
and fleets it was not tuned on?

    python -m loadtest.bench.family [--members 12] [--requests 400] [--seed 1]
        [--mooncake-dir DIR] [--arms quickstart,told,vllm,sglang] [--quick]

Members (family_members.py): the project's traces and slices of Mooncake's production traces
(kvcache-ai/Mooncake, FAST'25 release: download `FAST25-release/traces/*_trace.jsonl` into DIR;
without it the Mooncake members take the project's traces and the run says so), each on a fleet
drawn from ranges (2-8 replicas, prefill rate, HBM, CPU and remote tiers, vLLM V1 step flags,
decode step, fcfs or priority) at a drawn load. Every replica is a simulated vLLM V1 engine that
decodes in its steps (loadtest/sim/steps.py), started fresh for each arm (every cache empty).

Arms:
  quickstart  cachelane `serve --replicas URLS`: told nothing.
  told        cachelane with a config stating the fleet's facts: HBM and CPU capacity, the
              prefill rate, the remote tier, and the engines' step flags (`engine:`).
  vllm        vllm-router 0.1.17 kv_aware, on the sims' KV events.
  sglang      sglang-router 0.3.2 cache_aware.

Per member and arm: hit rate (cached / prompt tokens from the replicas' usage), hit / ideal (one
unlimited cache), TTFT p50/p90/p99, excess over each request's own floor p90/p99 (its uncached
prefill alone on an idle replica in the engine's steps, every block an earlier request had reused
for free: critical_traces.ideal_floor; no router beats it), the busiest replica's prompt tokens
over the mean, and for cachelane the estimate's error (p90 of |est - obs| / obs, TTFT >= 50 ms,
after the first 50 requests). Across the family: each cachelane arm's ratio to the better peer
(TTFT and excess: the lower peer's; hit: the higher), the median and the worst decile. Writes
results/bench_family.json and results/bench_family.png. The machine's two cores are shared by
client, router and fleet: compare arms within a member, as ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.table import Table

from loadtest.bench import figures, harness, report
from loadtest.bench.critical_fleet import scrape
from loadtest.bench.family_members import MODEL, Member, draw_member
from loadtest.bench.peer_routers import RouterSpec, kv_aware_args, running_router
from loadtest.bench.processes import free_port, gateway_from_config, loopback_urls, sim_from_config
from loadtest.bench.replay import (
    RequestResult,
    at_offsets,
    errors_into,
    open_client,
    request_body,
    stream_into,
)
from loadtest.bench.report import ms
from loadtest.workloads.traces import TraceRecord
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS
from routing.whatif.summary import percentile

OUT = Path("results/bench_family.json")
ARMS = ("quickstart", "told", "vllm", "sglang")
CACHELANE_ARMS = ("quickstart", "told")
PEER_ARMS = ("vllm", "sglang")
MEMBERS = 12
REQUESTS = 400  # per member: ~40-80 s of trace at 5-10 requests/s
QUICK_MEMBERS, QUICK_REQUESTS = 2, 40

REQUEST_TIMEOUT_S = 60.0
# Send to last byte. The slowest floors (a 15k-token Mooncake prompt at 2k tokens/s) are ~8 s;
# past 60 s a request counts as failed, and an arm waits at most this long after its last arrival.
HTTP_TIMEOUT_S = 5.0  # connects and the sims' metrics on loopback
MAX_CONNECTIONS = 1024
EST_MIN_TTFT_S = 0.05
EST_SKIP_FIRST = 50
# The estimate's error, as the estimate benchmark counts it (docs/bench/estimate.md): TTFTs of at
# least 50 ms (below, a few ms of the shared cores' jitter is a large share), after the first 50
# requests (a fresh gateway learns the fleet from them).

GOALS = {
    "quickstart": {
        "every member": {
            "ttft_p90": ("<=", 1.0),
            "ttft_p99": ("<=", 1.0),
            "excess_p99": ("<=", 1.0),
            "hit_points": (">=", -0.5),
        }
    },
    "told": {
        "median": {"excess_p90": ("<=", 0.7), "excess_p99": ("<=", 0.7)},
        "worst decile": {"excess_p90": ("<=", 1.0), "excess_p99": ("<=", 1.0)},
    },
}
# What the family is held to: the quick start never worse than the better peer (TTFT and excess
# as ratios, hit rate in points); told the fleet, a clear gain on the median member.


# --- one arm ---------------------------------------------------------------------------------


@dataclass(slots=True)
class FamilyResult(RequestResult):
    est_ttft_ms: float | None = None  # cachelane's x-cachelane-est-ttft-ms


@dataclass(frozen=True)
class Ports:
    """One member's loopback addresses, the same for every arm."""

    replicas: list[str]
    remote: str | None
    events: dict[str, str]  # replica URL -> its KV event socket (for vllm-router kv_aware)

    @classmethod
    def free(cls, member: Member) -> Ports:
        urls = loopback_urls(member.fleet.replicas + 1)
        events = {u: f"tcp://127.0.0.1:{free_port()}" for u in urls[1:]}
        return cls(urls[1:], urls[0] if member.fleet.remote else None, events)


def _pool(member: Member, ports: Ports, *, sim: bool) -> dict[str, Any]:
    f = member.fleet
    pool: dict[str, Any] = {
        "name": "fleet",
        "replicas": list(ports.replicas),
        "models": [MODEL],
        "hbm_capacity_tokens": f.hbm_tokens,
        "cpu_capacity_tokens": f.cpu_tokens,
        "costs": {"prefill_tokens_per_s": f.prefill_tokens_per_s},
    }
    if ports.remote:
        pool["remote_tier"] = "kv"
    if sim:
        pool["sim"] = {"itl_s": f.decode_step_s, "scheduling_policy": f.scheduling_policy}
        pool["kv_events"] = {"endpoints": dict(ports.events)}
    else:
        pool["engine"] = {
            "max_num_batched_tokens": f.max_num_batched_tokens,
            "long_prefill_token_threshold": f.long_prefill_token_threshold,
            "scheduling_policy": f.scheduling_policy,
        }
    return pool


def fleet_config(member: Member, ports: Ports, *, sim: bool) -> dict[str, Any]:
    """The sims' config (sim=True), or the `told` arm's: the same pool, the engine flags."""
    config: dict[str, Any] = {"pools": [_pool(member, ports, sim=sim)]}
    if ports.remote:
        config["remote_tiers"] = [{"name": "kv", "url": ports.remote}]
    return config


async def replay_member(trace: Sequence[TraceRecord], base_url: str) -> list[FamilyResult]:
    results = [FamilyResult(i, r["tenant"], r["endpoint"], r["t_s"]) for i, r in enumerate(trace)]
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=HTTP_TIMEOUT_S)
    async with open_client(base_url, MAX_CONNECTIONS, timeout, trust_env=False) as client:
        loop = asyncio.get_running_loop()

        async def one(i: int, record: TraceRecord, due_s: float) -> None:
            result = results[i]
            result.send_lag_s = max(0.0, loop.time() - due_s)

            def read_headers(resp: httpx.Response) -> None:
                est = resp.headers.get("x-cachelane-est-ttft-ms")
                result.est_ttft_ms = float(est) if est else None

            with errors_into(result, "cancelled at the arm's deadline"):
                try:
                    async with asyncio.timeout(REQUEST_TIMEOUT_S):
                        body = request_body(record, MODEL)
                        await stream_into(client, record, body, result, on_headers=read_headers)
                except TimeoutError:
                    result.error = f"timed out after {REQUEST_TIMEOUT_S:.0f} s"

        await at_offsets(trace, one, drain_timeout_s=REQUEST_TIMEOUT_S + 5.0)
    return results


def _prompt_tokens(urls: Sequence[str]) -> dict[str, float]:
    return {u: sum(scrape(u, ("vllm:prompt_tokens",)).values()) for u in urls}


def run_arm(arm: str, member: Member, ports: Ports, logs: Path) -> ArmStats:
    sims = fleet_config(member, ports, sim=True)
    name = f"{member.name}-{arm}"
    with sim_from_config(sims, logs, name, member.fleet.sim_args()):
        before = _prompt_tokens(ports.replicas)
        started = time.perf_counter()
        if arm in CACHELANE_ARMS:
            if arm == "told":
                with gateway_from_config(fleet_config(member, ports, sim=False), logs, name) as gw:
                    results = asyncio.run(replay_member(member.trace, gw.url))
            else:
                spec = RouterSpec("cachelane", "cache_aware")  # `serve --replicas`: the default
                with running_router(spec, ports.replicas, logs) as router:
                    results = asyncio.run(replay_member(member.trace, router.url))
        else:
            spec = peer_spec(arm, ports)
            with running_router(spec, ports.replicas, logs) as router:
                results = asyncio.run(replay_member(member.trace, router.url))
        elapsed = time.perf_counter() - started
        after = _prompt_tokens(ports.replicas)
    report.write_results_jsonl(logs / f"{name}-requests.jsonl", results)
    per_replica = [after[u] - before.get(u, 0.0) for u in ports.replicas]
    return arm_stats(arm, member, results, per_replica, elapsed)


def peer_spec(arm: str, ports: Ports) -> RouterSpec:
    if arm == "vllm":
        extra = kv_aware_args(ports.events, DEFAULT_BLOCK_SIZE_TOKENS, MODEL)
        return RouterSpec("vllm", "kv_aware", extra_args=extra)
    return RouterSpec("sglang", "cache_aware")


# --- statistics ------------------------------------------------------------------------------


@dataclass
class ArmStats:
    arm: str
    requests: int
    failed: int
    hit: float
    hit_over_ideal: float
    ttft_ms: dict[str, float]  # p50, p90, p99
    excess_ms: dict[str, float]  # p50, p90, p99
    max_over_mean: float  # the busiest replica's prompt tokens over the mean
    est_error_p50: float | None
    est_error_p90: float | None
    elapsed_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _pcts(values: Sequence[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


def arm_stats(
    arm: str,
    member: Member,
    results: Sequence[FamilyResult],
    per_replica: Sequence[float],
    elapsed_s: float,
) -> ArmStats:
    ok = [r for r in results if r.ok and r.ttft_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    hit = sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0
    floor = member.floor.per_request
    excess = [
        r.ttft_s * 1000 - f  # type: ignore[operator]
        for r in ok
        if (f := floor[r.index]) is not None
    ]
    errors = [
        abs(r.est_ttft_ms / 1000 - r.ttft_s) / r.ttft_s  # type: ignore[operator]
        for r in ok
        if r.est_ttft_ms is not None and r.index >= EST_SKIP_FIRST and r.ttft_s >= EST_MIN_TTFT_S  # type: ignore[operator]
    ]
    mean = sum(per_replica) / len(per_replica) if per_replica else 0.0
    return ArmStats(
        arm=arm,
        requests=len(results),
        failed=len(results) - len(ok),
        hit=hit,
        hit_over_ideal=hit / member.ideal_hit if member.ideal_hit else float("nan"),
        ttft_ms=_pcts([r.ttft_s * 1000 for r in ok]),  # type: ignore[operator]
        excess_ms=_pcts(excess),
        max_over_mean=max(per_replica) / mean if mean else float("nan"),
        est_error_p50=percentile(errors, 50) if errors else None,
        est_error_p90=percentile(errors, 90) if errors else None,
        elapsed_s=elapsed_s,
    )


RATIO_KEYS = ("ttft_p50", "ttft_p90", "ttft_p99", "excess_p90", "excess_p99")


def _metric(stats: ArmStats, key: str) -> float:
    kind, q = key.split("_")
    return (stats.ttft_ms if kind == "ttft" else stats.excess_ms)[q]


def ratios_to_peers(arms: Mapping[str, ArmStats]) -> dict[str, dict[str, float]]:
    """Each cachelane arm against the better peer: TTFT and excess as ratios to the lower peer
    figure (excess below 1 ms counts as 1 ms: the floor's own rounding), hit in points above
    the higher peer."""
    peers = [arms[p] for p in PEER_ARMS if p in arms]
    if not peers:
        return {}
    out: dict[str, dict[str, float]] = {}
    for arm in CACHELANE_ARMS:
        if arm not in arms:
            continue
        mine = arms[arm]
        row = {}
        for key in RATIO_KEYS:
            best = min(_metric(p, key) for p in peers)
            row[key] = max(_metric(mine, key), 1.0) / max(best, 1.0)
        row["hit_points"] = 100 * (mine.hit - max(p.hit for p in peers))
        out[arm] = row
    return out


def family_summary(per_member: Sequence[Mapping[str, Mapping[str, float]]]) -> dict[str, Any]:
    """Per cachelane arm and ratio: the median member and the worst decile (the 90th percentile
    of a ratio, the 10th of the hit points), and the worst member."""
    out: dict[str, Any] = {}
    for arm in CACHELANE_ARMS:
        rows = [m[arm] for m in per_member if arm in m]
        if not rows:
            continue
        arm_out = {}
        for key in (*RATIO_KEYS, "hit_points"):
            values = [r[key] for r in rows]
            worse_high = key != "hit_points"
            arm_out[key] = {
                "median": percentile(values, 50),
                "worst_decile": percentile(values, 90 if worse_high else 10),
                "worst": max(values) if worse_high else min(values),
            }
        out[arm] = arm_out
    return out


def goal_verdicts(
    per_member: Sequence[Mapping[str, Mapping[str, float]]], summary: Mapping[str, Any]
) -> list[tuple[str, str, float, str, float, bool]]:
    """(arm, scope:key, value, op, goal, met) for every goal in GOALS."""
    out = []
    for arm, scopes in GOALS.items():
        if arm not in summary:
            continue
        for scope, goals in scopes.items():
            for key, (op, goal) in goals.items():
                stat = {"every member": "worst", "median": "median", "worst decile": "worst_decile"}
                value = summary[arm][key][stat[scope]]
                met = value <= goal if op == "<=" else value >= goal
                out.append((arm, f"{scope}: {key}", value, op, goal, met))
    return out


# --- output ----------------------------------------------------------------------------------


def member_table(member: Member, arms: Mapping[str, ArmStats]) -> Table:
    f = member.fleet
    title = (
        f"{member.name}: {len(member.trace)} requests at {member.rate_per_s:.1f}/s, load "
        f"{member.load:.2f}, ideal hit {member.ideal_hit:.3f}; {f.replicas} x "
        f"{f.prefill_tokens_per_s:,.0f} tok/s, {f.tiers}, budget {f.max_num_batched_tokens}"
        f"{f' threshold {f.long_prefill_token_threshold}' * bool(f.long_prefill_token_threshold)}"
        f", {f.scheduling_policy}, decode {f.decode_step_s * 1000:.0f} ms"
    )
    table = Table(title=title, title_justify="left")
    cols = ("arm", "hit", "hit/ideal", "TTFT p50", "p90", "p99", "excess p90", "p99")
    for c in (*cols, "max/mean", "est err p90", "failed"):
        table.add_column(c, justify="left" if c == "arm" else "right")
    for arm, s in arms.items():
        est = "" if s.est_error_p90 is None else f"{s.est_error_p90:.2f}"
        table.add_row(
            arm,
            f"{s.hit:.3f}",
            f"{s.hit_over_ideal:.2f}",
            ms(s.ttft_ms["p50"]),
            ms(s.ttft_ms["p90"]),
            ms(s.ttft_ms["p99"]),
            ms(s.excess_ms["p90"]),
            ms(s.excess_ms["p99"]),
            f"{s.max_over_mean:.2f}",
            est,
            str(s.failed),
        )
    return table


def summary_table(summary: Mapping[str, Any], members: int) -> Table:
    table = Table(
        title=f"cachelane / better peer over {members} members: median, worst decile, worst",
        title_justify="left",
    )
    table.add_column("arm")
    for key in (*RATIO_KEYS, "hit_points"):
        table.add_column(key.replace("_", " "), justify="right")
    for arm, row in summary.items():
        cells = []
        for key in (*RATIO_KEYS, "hit_points"):
            v = row[key]
            fmt = "{:+.1f}" if key == "hit_points" else "{:.2f}x"
            cells.append(" / ".join(fmt.format(v[s]) for s in ("median", "worst_decile", "worst")))
        table.add_row(arm, *cells)
    return table


def draw(path: Path, names: Sequence[str], per_member: Sequence[Mapping[str, Any]]) -> None:
    """Per member, each cachelane arm's excess p99 and TTFT p99 over the better peer's."""
    plt = figures.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), sharey=False)
    width = 0.38
    xs = range(len(names))
    for ax, key, label in (
        (axes[0], "excess_p99", "excess p99 / better peer"),
        (axes[1], "ttft_p99", "TTFT p99 / better peer"),
        (axes[2], "hit_points", "hit rate - better peer (points)"),
    ):
        for j, arm in enumerate(CACHELANE_ARMS):
            vals = [m.get(arm, {}).get(key, float("nan")) for m in per_member]
            ax.bar([x + (j - 0.5) * width for x in xs], vals, width, label=arm)
        ax.axhline(0.0 if key == "hit_points" else 1.0, color="black", lw=1)
        if key != "hit_points":
            ax.set_yscale("log")
        ax.set_title(label)
        ax.set_xticks(list(xs), names, rotation=60, ha="right", fontsize=8)
    axes[0].legend()
    figures.save_figure(
        fig, path, title="cachelane against the better of vllm-router and sglang-router"
    )


def markdown(payload: Mapping[str, Any]) -> str:
    """The run as the tables docs/bench/family.md shows: per member and arm, then the family."""
    lines = [
        "| member | fleet | arm | hit (ideal) | TTFT p50 / p90 / p99 | excess p90 / p99 "
        "| est. miss p90 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in payload["members"]:
        f = m["fleet"]
        tiers = "+".join(["hbm"] + ["cpu"] * bool(f["cpu_tokens"]) + ["remote"] * f["remote"])
        threshold = f["long_prefill_token_threshold"]
        fleet = (
            f"{f['replicas']} x {f['prefill_tokens_per_s']:,.0f} tok/s, {tiers}, budget "
            f"{f['max_num_batched_tokens']}{f' thr {threshold}' * bool(threshold)}, "
            f"{f['scheduling_policy']}, decode {f['decode_step_s'] * 1000:.0f} ms, "
            f"load {m['load']:.2f}"
        )
        for i, (arm, a) in enumerate(m["arms"].items()):
            t, e = a["ttft_ms"], a["excess_ms"]
            est = "" if a["est_error_p90"] is None else f"{a['est_error_p90']:.2f}"
            lines.append(
                f"| {m['name'] if i == 0 else ''} | {fleet if i == 0 else ''} | {arm} | "
                f"{a['hit']:.3f} ({m['ideal_hit']:.3f}) | {t['p50']:,.0f} / {t['p90']:,.0f} / "
                f"{t['p99']:,.0f} | {e['p90']:,.0f} / {e['p99']:,.0f} | {est} |"
            )
    lines += [
        "",
        "| arm | ratio to the better peer | median | worst decile | worst |",
        "| --- | --- | --- | --- | --- |",
    ]
    for arm, row in payload["summary"].items():
        for key, v in row.items():
            fmt = "{:+.1f}" if key == "hit_points" else "{:.2f}x"
            cells = " | ".join(fmt.format(v[s]) for s in ("median", "worst_decile", "worst"))
            lines.append(f"| {arm} | {key.replace('_', ' ')} | {cells} |")
    return "\n".join(lines) + "\n"


# --- main ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = harness.parser("family", __doc__ or "", quick="2 members of 40 requests: a smoke run")
    p.add_argument("--members", type=int, default=MEMBERS)
    p.add_argument("--first-member", type=int, default=0, help="draw members from this index")
    p.add_argument("--requests", type=int, default=REQUESTS, help="per member")
    p.add_argument(
        "--mooncake-dir",
        type=Path,
        default=None,
        help="folder of Mooncake's FAST'25 traces (<name>_trace.jsonl); none: project traces only",
    )
    p.add_argument(
        "--trace",
        default=None,
        help="every member on this trace instead: a name (mixed, chat, rag, agentic, "
        "shared_system, mooncake:conversation, ...) or mooncake:PATH[@START:COUNT], a file",
    )
    harness.add_names(p, "--arms", ARMS, "arms")
    harness.add_seed_and_out(p, OUT)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = harness.console(200)
    members_n, requests = (
        (QUICK_MEMBERS, QUICK_REQUESTS) if args.quick else (args.members, args.requests)
    )
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        out.print(f"[red]unknown arms {sorted(unknown)}; known: {', '.join(ARMS)}")
        return harness.FAILED
    mooncake_dir = args.mooncake_dir
    if mooncake_dir is not None and not mooncake_dir.is_dir():
        out.print(f"[red]--mooncake-dir {mooncake_dir} is not a folder")
        return harness.FAILED
    if mooncake_dir is None:
        out.print("[yellow]no --mooncake-dir: the public-trace members run the project's traces")
    not_run: dict[str, str] = {}
    for kind in {"vllm": "vllm", "sglang": "sglang"}.values():
        if kind in arms and (error := harness.peer_router_error(out, kind)):
            not_run[kind] = error
            arms.remove(kind)
    logs = harness.log_dir(args.out)
    started = time.perf_counter()
    done: list[tuple[Member, dict[str, ArmStats]]] = []

    def run_all() -> None:
        for index in range(args.first_member, args.first_member + members_n):
            member = draw_member(index, args.seed, requests, mooncake_dir, args.trace)
            ports = Ports.free(member)
            order = arms[index % len(arms) :] + arms[: index % len(arms)]  # alternate the order
            stats: dict[str, ArmStats] = {}
            for arm in order:
                label = f"{member.name}/{arm}"
                result = harness.try_arm(
                    out,
                    label,
                    not_run,
                    lambda a=arm, m=member, p=ports: run_arm(a, m, p, logs),  # type: ignore[misc]
                )
                if result is not None:
                    stats[arm] = result
            stats = {a: stats[a] for a in arms if a in stats}
            done.append((member, stats))
            out.print(member_table(member, stats))

    code = harness.run_arms(out, "family", run_all, harness.ARM_ERRORS)
    per_member = [ratios_to_peers(stats) for _, stats in done]
    summary = family_summary(per_member)
    if summary:
        out.print(summary_table(summary, len(done)))
        for arm, key, value, op, goal, met in goal_verdicts(per_member, summary):
            mark = "[green]met" if met else "[red]not met"
            out.print(f"  {arm:<10} {key:<28} {value:7.2f} {op} {goal:<5} {mark}")
    harness.print_not_run(out, not_run)
    payload = {
        "seed": args.seed,
        "requests_per_member": requests,
        "mooncake_dir": str(mooncake_dir) if mooncake_dir else None,
        "members": [
            {
                **m.describe(),
                "floor_ms": m.floor.to_dict().get("all", {}),
                "arms": {a: s.to_dict() for a, s in stats.items()},
                "ratios_to_better_peer": r,
            }
            for (m, stats), r in zip(done, per_member, strict=True)
        ],
        "summary": summary,
        "goals": [
            {"arm": a, "goal": k, "value": v, "op": op, "target": g, "met": met}
            for a, k, v, op, g, met in goal_verdicts(per_member, summary)
        ],
        "not_run": not_run,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(markdown(payload))
    harness.write_results(
        out,
        args.out,
        payload,
        lambda png: draw(png, [m.name for m, _ in done], per_member),
        time.perf_counter() - started,
        logs,
    )
    return code


if __name__ == "__main__":
    raise SystemExit(main())
