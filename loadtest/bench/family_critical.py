"""Latency-critical tenants on a family of tiered fleets: the critical benchmark's trace and arms
on fleets drawn from ranges, every request against its own floor.

    python -m loadtest.bench.family_critical [--members 6] [--seed 1] [--quick]
        [--arms no-tenants,priority,pinned,vllm,sglang]

Each member draws a tiered fleet (3-8 replicas: a third HBM-only, the rest with a CPU tier of
2-4x their HBM and one shared remote tier; HBM 16-32k tokens; vLLM V1 step flags, decode step
and scheduling policy as the family draws them, loadtest/bench/family_members.py) and the
critical benchmark's four tenants (loadtest/workloads/critical_traces.py: voice and agent
critical, chat+RAG and bulk standard) at 40-70% of its rates, with the prefill rate set for a
drawn load of 0.6-0.95 of the fleet's prefill under round robin. Every arm runs on sims started
for it, after a warm-up that is replayed but not counted:

  no-tenants  cachelane told the fleet, every request alike, flow control off.
  priority    the same pools, the tenants' classes (the engines' priority where they schedule by
              it), critical.clear_while_loading.
  pinned      the HBM-only replicas a pinned pool with default knobs.
  vllm        vllm-router kv_aware (the sims' KV events); sglang: sglang-router cache_aware.

Per member (critical_results.goal_ratios): the tenant arms' critical excess p99 and overall TTFT
p99 over the better peer's, hit rate in points; the pinned arm's critical and overall p99 over
no-tenants'. Across the family: the median member and the worst. Writes
results/bench_family_critical.json (and .md, the tables docs/bench/family.md shows).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.bench import harness, report
from loadtest.bench.critical import REQUEST_TIMEOUT_S, replay_trace, tenants_config
from loadtest.bench.critical_results import ArmResult, goal_ratios
from loadtest.bench.family_members import (
    BUDGET_TOKENS,
    DECODE_STEP_S,
    THRESHOLD_SHARE,
    FleetDraw,
    log_uniform,
)
from loadtest.bench.peer_routers import RouterSpec, kv_aware_args, running_router
from loadtest.bench.processes import free_port, gateway_from_config, loopback_urls, sim_from_config
from loadtest.sim.config import SIM_MODEL
from loadtest.workloads import critical_traces as ct
from loadtest.workloads.traces import ServiceBound, TraceRecord
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS
from routing.whatif.summary import percentile

OUT = Path("results/bench_family_critical.json")
ARMS = ("no-tenants", "priority", "pinned", "vllm", "sglang")
MEMBERS = 6
DURATION_S, WARMUP_S = 30.0, 8.0
QUICK_MEMBERS, QUICK_DURATION_S, QUICK_WARMUP_S = 1, 5.0, 2.0
REPLICAS = (3, 8)
HBM_TOKENS = (16_000, 32_000)  # a handful of 2-10k-token agent contexts (critical_fleet.py)
CPU_TIMES_HBM = (2.0, 4.0)
RATE_SCALE = (0.4, 0.7)  # of ct.Mix's ~17 requests/s: 7-12/s, what two shared cores drive
LOAD = (0.6, 0.95)  # of the fleet's prefill under round robin: the saturated regime
PRIORITY_SHARE = 0.7  # members whose engines schedule by priority (the others fcfs)
PREFILL_TOKENS_PER_S = (1_500.0, 40_000.0)

GOALS = {
    "critical_excess_p99_vs_best_peer": (("median", "<=", 0.5), ("worst", "<=", 1.0)),
    "all_ttft_p99_vs_best_peer": (("median", "<=", 0.9),),
    "critical_ttft_p99_vs_no_tenants": (("worst", "<=", 1.0),),
    "all_ttft_p99_vs_no_tenants": (("worst", "<=", 1.0),),
}
# The tenant arms against the better peer on the median member and at worst; the pinned pool
# never worse than no tenants.


@dataclass(frozen=True)
class CriticalMember:
    index: int
    trace: list[TraceRecord]
    hbm_only: int
    fleet: FleetDraw  # the offload replicas' CPU tier; every replica's engine
    load: float
    floor: ct.Floor
    warmup_s: float

    @property
    def name(self) -> str:
        return f"c{self.index:02d}"

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "requests": len(self.trace),
            "hbm_only_replicas": self.hbm_only,
            "load_round_robin": round(self.load, 3),
            "fleet": {k: getattr(self.fleet, k) for k in self.fleet.__dataclass_fields__},
            "floor_ms": self.floor.to_dict(),
        }


def draw(index: int, seed: int, duration_s: float, warmup_s: float) -> CriticalMember:
    rng = random.Random(f"family-critical-{seed}-{index}")
    replicas = rng.randint(*REPLICAS)
    hbm_only = max(1, round(replicas / 3))
    hbm = rng.randint(*HBM_TOKENS)
    cpu = round(hbm * rng.uniform(*CPU_TIMES_HBM))
    scale = rng.uniform(*RATE_SCALE)
    mix = ct.Mix({t: r * scale for t, r in ct.Mix().rates_per_s.items()})
    total_s = warmup_s + duration_s
    # a session's next turn waits for its previous one, at about half a modest replica's speed
    bound = ServiceBound(prefill_tokens_per_s=2_000.0, itl_s=0.06)
    trace = ct.critical_trace(mix, total_s, seed * 1000 + index, bound)
    load = rng.uniform(*LOAD)

    def shapes(prefill: float) -> list[ct.ReplicaShape]:
        plain = [ct.ReplicaShape(hbm, 0, False, prefill)] * hbm_only
        return plain + [ct.ReplicaShape(hbm, cpu, True, prefill)] * (replicas - hbm_only)

    at_one = ct.round_robin_load(trace, shapes(1.0), total_s, model=SIM_MODEL).rr_utilisation
    prefill = min(max(at_one / load, PREFILL_TOKENS_PER_S[0]), PREFILL_TOKENS_PER_S[1])
    budget = round(log_uniform(rng, *BUDGET_TOKENS) / 256) * 256
    fleet = FleetDraw(
        replicas=replicas,
        prefill_tokens_per_s=round(prefill),
        hbm_tokens=hbm,
        cpu_tokens=cpu,
        remote=True,
        max_num_batched_tokens=max(BUDGET_TOKENS[0], budget),
        long_prefill_token_threshold=budget // 4 if rng.random() < THRESHOLD_SHARE else 0,
        scheduling_policy="priority" if rng.random() < PRIORITY_SHARE else "fcfs",
        decode_step_s=round(rng.uniform(*DECODE_STEP_S), 4),
    )
    floor = ct.ideal_floor(
        trace, fleet.prefill_tokens_per_s, model=SIM_MODEL, since_s=warmup_s, steps=fleet.steps()
    )
    return CriticalMember(index, trace, hbm_only, fleet, at_one / prefill, floor, warmup_s)


# --- configs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ports:
    hbm_only: list[str]
    offload: list[str]
    remote: str
    events: dict[str, str]

    @property
    def replicas(self) -> list[str]:
        return [*self.hbm_only, *self.offload]

    @classmethod
    def free(cls, m: CriticalMember) -> Ports:
        urls = loopback_urls(m.fleet.replicas + 1)
        events = {u: f"tcp://127.0.0.1:{free_port()}" for u in urls[1:]}
        return cls(urls[1 : 1 + m.hbm_only], urls[1 + m.hbm_only :], urls[0], events)


def _pools(m: CriticalMember, ports: Ports, *, sim: bool, pinned: bool = False) -> list[Any]:
    f = m.fleet
    out = []
    for name, urls, offload in (
        ("hbm-only", ports.hbm_only, False),
        ("offload", ports.offload, True),
    ):
        pool: dict[str, Any] = {
            "name": "pinned" if pinned and not offload else name,
            "replicas": list(urls),
            "models": [SIM_MODEL],
            "hbm_capacity_tokens": f.hbm_tokens,
            "cpu_capacity_tokens": f.cpu_tokens if offload else 0,
            "costs": {"prefill_tokens_per_s": f.prefill_tokens_per_s},
        }
        if offload:
            pool["remote_tier"] = "kv"
        else:
            pool["hbm_only"] = True
        if sim:
            pool["sim"] = {"itl_s": f.decode_step_s, "scheduling_policy": f.scheduling_policy}
            pool["kv_events"] = {"endpoints": {u: ports.events[u] for u in urls}}
        else:
            pool["engine"] = {
                "max_num_batched_tokens": f.max_num_batched_tokens,
                "long_prefill_token_threshold": f.long_prefill_token_threshold,
                "scheduling_policy": f.scheduling_policy,
            }
            if pinned and not offload:
                pool["pinned"] = True
        out.append(pool)
    return out


def config(m: CriticalMember, ports: Ports, arm: str) -> dict[str, Any]:
    """The sims' config (arm "sim") or a cachelane arm's: the fleet's facts, as told."""
    tiers = [{"name": "kv", "url": ports.remote}]
    if arm == "sim":
        return {"remote_tiers": tiers, "pools": _pools(m, ports, sim=True)}
    pools = _pools(m, ports, sim=False, pinned=arm == "pinned")
    if arm == "no-tenants":
        return {"remote_tiers": tiers, "flow_control": {"enabled": False}, "pools": pools}
    extra = {"critical": {"clear_while_loading": True}} if arm == "priority" else {}
    return {"tenants": tenants_config(), "remote_tiers": tiers, "pools": pools, **extra}


def run_arm(arm: str, m: CriticalMember, ports: Ports, logs: Path) -> ArmResult:
    name = f"{m.name}-{arm}"
    with sim_from_config(config(m, ports, "sim"), logs, name, m.fleet.sim_args()):
        started = time.perf_counter()
        if arm in ("no-tenants", "priority", "pinned"):
            with gateway_from_config(config(m, ports, arm), logs, name) as gw:
                results = asyncio.run(replay_trace(m.trace, gw.url, REQUEST_TIMEOUT_S))
        else:
            if arm == "vllm":
                extra = kv_aware_args(ports.events, DEFAULT_BLOCK_SIZE_TOKENS, SIM_MODEL)
                spec = RouterSpec("vllm", "kv_aware", extra_args=extra)
            else:
                spec = RouterSpec("sglang", "cache_aware")
            with running_router(spec, ports.replicas, logs) as router:
                results = asyncio.run(replay_trace(m.trace, router.url, REQUEST_TIMEOUT_S))
        elapsed = time.perf_counter() - started
    report.write_results_jsonl(logs / f"{name}-requests.jsonl", results)
    return ArmResult(arm, elapsed, results, {}, m.floor.per_request, warmup_s=m.warmup_s)


# --- across the family -----------------------------------------------------------------------


def summary(per_member: Sequence[Mapping[str, Mapping[str, float]]]) -> dict[str, Any]:
    """Per tenant arm and ratio: the median member and the worst (NaN members left out)."""
    out: dict[str, Any] = {}
    for arm in ("priority", "pinned"):
        rows = [m[arm] for m in per_member if arm in m]
        keys = sorted({k for r in rows for k in r})
        arm_out = {}
        for key in keys:
            values = [r[key] for r in rows if key in r and not math.isnan(r[key])]
            if not values:
                continue
            worse_high = not key.startswith("hit")
            arm_out[key] = {
                "median": percentile(values, 50),
                "worst": max(values) if worse_high else min(values),
            }
        if arm_out:
            out[arm] = arm_out
    return out


def verdicts(summ: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    for arm, row in summ.items():
        for key, checks in GOALS.items():
            if key not in row or (arm == "priority" and key.endswith("no_tenants")):
                continue
            for stat, op, goal in checks:
                value = row[key][stat]
                met = value <= goal if op == "<=" else value >= goal
                out.append({"arm": arm, "goal": f"{stat} {key}", "value": value, "op": op,
                            "target": goal, "met": met})  # fmt: skip
    return out


def markdown(payload: Mapping[str, Any]) -> str:
    lines = [
        "| member | fleet | arm | critical TTFT p99 | critical excess p99 | all TTFT p99 | hit |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in payload["members"]:
        f = m["fleet"]
        fleet = (
            f"{m['hbm_only_replicas']} HBM-only + {f['replicas'] - m['hbm_only_replicas']} "
            f"tiered x {f['prefill_tokens_per_s']:,} tok/s, budget {f['max_num_batched_tokens']}"
            f", {f['scheduling_policy']}, decode {f['decode_step_s'] * 1000:.0f} ms, load "
            f"{m['load_round_robin']:.2f}"
        )
        for i, (arm, a) in enumerate(m["arms"].items()):
            crit, every = a["critical"], a["all"]
            lines.append(
                f"| {m['name'] if i == 0 else ''} | {fleet if i == 0 else ''} | {arm} | "
                f"{crit['ttft_p99_ms']:,.0f} | {crit['excess_p99_ms']:,.0f} | "
                f"{every['ttft_p99_ms']:,.0f} | {every['hit_rate']:.3f} |"
            )
    lines += ["", "| arm | ratio | median | worst |", "| --- | --- | --- | --- |"]
    for arm, row in payload["summary"].items():
        for key, v in row.items():
            fmt = "{:+.3f}" if key.startswith("hit") else "{:.2f}x"
            lines.append(
                f"| {arm} | {key} | {fmt.format(v['median'])} | {fmt.format(v['worst'])} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser("family_critical", __doc__ or "", quick="1 member, 5 s: a smoke run")
    p.add_argument("--members", type=int, default=MEMBERS)
    p.add_argument("--first-member", type=int, default=0)
    harness.add_names(p, "--arms", ARMS, "arms")
    harness.add_seed_and_out(p, OUT)
    args = p.parse_args(argv)
    out = harness.console(200)
    arms = [a for a in args.arms.split(",") if a]
    if set(arms) - set(ARMS):
        out.print(f"[red]unknown arms {sorted(set(arms) - set(ARMS))}; known: {', '.join(ARMS)}")
        return harness.FAILED
    members, duration_s, warmup_s = (
        (QUICK_MEMBERS, QUICK_DURATION_S, QUICK_WARMUP_S)
        if args.quick
        else (args.members, DURATION_S, WARMUP_S)
    )
    not_run: dict[str, str] = {}
    for kind in ("vllm", "sglang"):
        if kind in arms and (error := harness.peer_router_error(out, kind)):
            not_run[kind] = error
            arms.remove(kind)
    logs = harness.log_dir(args.out)
    started = time.perf_counter()
    done: list[tuple[CriticalMember, dict[str, ArmResult]]] = []

    def run_all() -> None:
        for index in range(args.first_member, args.first_member + members):
            m = draw(index, args.seed, duration_s, warmup_s)
            ports = Ports.free(m)
            order = arms[index % len(arms) :] + arms[: index % len(arms)]
            results: dict[str, ArmResult] = {}
            for arm in order:
                r = harness.try_arm(
                    out, f"{m.name}/{arm}", not_run,
                    lambda a=arm, mm=m, pp=ports: run_arm(a, mm, pp, logs),  # type: ignore[misc]
                )  # fmt: skip
                if r is not None:
                    results[arm] = r
                    crit, every = r.stats("critical"), r.stats("all")
                    out.print(
                        f"{m.name} {arm:<10} critical p99 {crit['ttft_p99_ms']:7.0f} excess p99 "
                        f"{crit['excess_p99_ms']:7.0f}  all p99 {every['ttft_p99_ms']:7.0f} ms  "
                        f"hit {every['hit_rate']:.3f}  failed {every['failed']}"
                    )
            done.append((m, {a: results[a] for a in arms if a in results}))

    code = harness.run_arms(out, "family_critical", run_all, harness.ARM_ERRORS)
    per_member = [goal_ratios(r) for _, r in done]
    summ = summary(per_member)
    checks = verdicts(summ)
    for c in checks:
        mark = "[green]met" if c["met"] else "[red]not met"
        out.print(
            f"  {c['arm']:<9} {c['goal']:<42} {c['value']:6.2f} {c['op']} {c['target']} {mark}"
        )
    harness.print_not_run(out, not_run)
    payload = {
        "seed": args.seed,
        "duration_s": duration_s,
        "warmup_s": warmup_s,
        "members": [
            {
                **m.describe(),
                "arms": {
                    a: {g: r.stats(g) for g in ("critical", "standard", "all")}
                    for a, r in res.items()
                },
                "ratios": ratios,
            }
            for (m, res), ratios in zip(done, per_member, strict=True)
        ],
        "summary": summ,
        "goals": checks,
        "not_run": not_run,
    }
    report.write_json(args.out, payload)
    args.out.with_suffix(".md").write_text(markdown(payload))
    out.print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s; logs in {logs}/")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
