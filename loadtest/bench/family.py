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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench import harness, report
from loadtest.bench.critical_fleet import scrape
from loadtest.bench.family_members import MODEL, Member, draw_member
from loadtest.bench.family_report import draw, markdown, member_table, summary_table
from loadtest.bench.family_stats import (
    CACHELANE_ARMS,
    ArmStats,
    FamilyResult,
    arm_stats,
    family_summary,
    goal_verdicts,
    ratios_to_peers,
)
from loadtest.bench.peer_routers import RouterSpec, kv_aware_args, running_router
from loadtest.bench.processes import free_port, gateway_from_config, loopback_urls, sim_from_config
from loadtest.bench.replay import (
    at_offsets,
    errors_into,
    open_client,
    request_body,
    stream_into,
)
from loadtest.workloads.traces import TraceRecord
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS

OUT = Path("results/bench_family.json")
ARMS = ("quickstart", "told", "vllm", "sglang")
MEMBERS = 12
REQUESTS = 400  # per member: ~40-80 s of trace at 5-10 requests/s
QUICK_MEMBERS, QUICK_REQUESTS = 2, 40

REQUEST_TIMEOUT_S = 60.0
# Send to last byte. The slowest floors (a 15k-token Mooncake prompt at 2k tokens/s) are ~8 s;
# past 60 s a request counts as failed, and an arm waits at most this long after its last arrival.
HTTP_TIMEOUT_S = 5.0  # connects and the sims' metrics on loopback
MAX_CONNECTIONS = 1024
# --- one arm ---------------------------------------------------------------------------------


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
