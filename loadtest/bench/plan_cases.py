"""The three cases of docs/planning.md on the simulated fleet: what the report says about each,
and what `cachelane plan` answers from its capture.

    python -m loadtest.bench.plan_cases                 # ~6 minutes: 4 runs of 30 s, then plans
    python -m loadtest.bench.plan_cases --duration-s 5  # checks the machinery

  pcie         CPU offload under multi-tenant PCIe pressure: two tenants of long documents and
               one-off prompts (Llama-3.1-70B KV on a PCIe Gen4 host), replicas with a CPU tier
  remote-high  a remote tier at high reuse (questions about 24 shared documents)
  remote-low   the same fleet at low reuse (mostly one-off long prompts)
  voice        a critical voice tenant beside a standard burst on one shared offload pool

Each run: a sim fleet, a gateway with `capture.path` and an admin key, the seeded traces
replayed open-loop; then `cachelane report` on the gateway (its text and PNG) and `cachelane
plan` on the capture (its table, JSON and PNG), all under results/plan_cases/CASE/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from gateway.accounting.findings import findings, merge
from gateway.cli import plan as plan_cli
from gateway.cli.report import draw, fetch_windows, render
from loadtest.bench.processes import (
    gateway_from_config,
    loopback_urls,
    sigterm_as_interrupt,
    sim_from_config,
)
from loadtest.bench.replay import replay
from loadtest.bench.tier_experiment import COSTS_70B
from loadtest.sim.config import SIM_MODEL
from loadtest.workloads import tier_traces
from loadtest.workloads.tier_traces import Rate
from loadtest.workloads.traces import TraceRecord

DURATION_S = 30.0  # per run: ~250 requests, enough for each class's p50 and a rough p99
SEED = 0
ADMIN_KEY = "plan-cases-admin-key-0123456789abcdef0123"
OUT = Path("results/plan_cases")

PCIE_GEN4_COSTS = {
    **COSTS_70B,
    # PCIe Gen4 x16: 32 GB/s theoretical (16 GT/s x 16 lanes, 128b/130b), ~25 GB/s for pinned
    # copies (the same ~80% as routing/cost.py's Gen5 figure). An assumed topology: the TP4
    # replica's GPUs sit behind one PCIe switch whose x16 uplink to the host is shared, so every
    # swap-in of the replica crosses that one link.
    "pcie_gbps": 25.0,
}
HALF_BURST = Rate(
    tier_traces.STANDARD_RATE.base_per_s / 2, tier_traces.STANDARD_RATE.burst_per_s / 2
)
# Two standard tenants at half tier_traces.STANDARD_RATE each: the same offered load as the tier
# benchmark's one tenant, split between two document sets that compete for HBM and PCIe.


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    costs: dict[str, float]
    hbm_tokens: int
    cpu_tokens: int
    remote: bool
    tenants: dict[str, str]  # tenant -> class
    plan_args: list[str] = field(default_factory=list)


CASES = {
    "pcie": Case(
        "pcie", "sim-llama-70b", PCIE_GEN4_COSTS, 24_000, 200_000, False,
        {"web": "standard", "docs": "standard"},
        ["--scenarios", "captured,hbm,hbm-x2,pcie-x0.25,pcie-x4"],
    ),
    "remote-high": Case(
        "remote-high", SIM_MODEL, {}, 12_000, 8_000, True, {"web": "standard"},
        ["--scenarios", "cpu,remote-reuse,remote-always", "--no-search"],
    ),
    "remote-low": Case(
        "remote-low", SIM_MODEL, {}, 12_000, 8_000, True, {"web": "standard"},
        ["--scenarios", "cpu,remote-reuse,remote-always", "--no-search"],
    ),
    "voice": Case(
        "voice", "sim-llama-70b", COSTS_70B, 24_000, 200_000, False,
        {"voice": "critical", "web": "standard"},
        ["--scenarios", "captured,pinned", "--target", "critical=150"],
    ),
}  # fmt: skip
REPLICAS = 4


def traces(case: str, duration_s: float) -> dict[str, list[TraceRecord]]:
    if case == "pcie":
        return {
            "web": tier_traces.standard_burst(HALF_BURST, duration_s, SEED),
            "docs": tier_traces.standard_burst(HALF_BURST, duration_s, SEED + 1),
        }
    if case == "remote-high":
        return {"web": tier_traces.reuse("high", tier_traces.REUSE_RATE_PER_S, duration_s, SEED)}
    if case == "remote-low":
        return {"web": tier_traces.reuse("low", tier_traces.REUSE_RATE_PER_S, duration_s, SEED)}
    return {
        "voice": tier_traces.voice(tier_traces.VOICE_RATE_PER_S, duration_s, SEED),
        "web": tier_traces.standard_burst(tier_traces.STANDARD_RATE, duration_s, SEED),
    }


def key_of(tenant: str) -> str:
    return f"{tenant}-plan-cases-key-0123456789abcdef0123456789"


def config_of(case: Case, replicas: list[str], remote: str) -> dict[str, Any]:
    pool: dict[str, Any] = {
        "name": "fleet",
        "replicas": replicas,
        "models": [case.model],
        "hbm_capacity_tokens": case.hbm_tokens,
        "cpu_capacity_tokens": case.cpu_tokens,
    }
    if case.costs:
        pool["costs"] = case.costs
    config: dict[str, Any] = {
        "tenants": [{"name": t, "api_key": key_of(t), "class": k} for t, k in case.tenants.items()],
        "admin": {"api_key": ADMIN_KEY},
        "pools": [pool],
    }
    if case.remote:
        pool |= {"remote_tier": "kv", "remote_write": "reuse"}
        config["remote_tiers"] = [{"name": "kv", "url": remote}]
    return config


async def _replay_all(url: str, model: str, by_tenant: dict[str, list[TraceRecord]]) -> None:
    await asyncio.gather(
        *(replay(t, url, model=model, api_key=key_of(name)) for name, t in by_tenant.items())
    )


def run_case(case: Case, duration_s: float, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    urls = loopback_urls(REPLICAS + 1)
    config = config_of(case, urls[1:], urls[0])
    capture = (out / "capture.jsonl").resolve()
    console = Console(record=True, width=160)
    with sim_from_config(config, out, case.name):
        gw_config = {**config, "capture": {"path": str(capture)}}
        with gateway_from_config(gw_config, out, case.name) as gw:
            asyncio.run(_replay_all(gw.url, case.model, traces(case.name, duration_s)))
            merged = merge(fetch_windows([gw.url], ADMIN_KEY, 900.0))
    console.print(f"[bold]cachelane report ({case.name})[/bold]")
    render(merged, findings(merged), console)
    draw(merged, out / "report.png")
    args = plan_cli.build_parser().parse_args(
        [str(capture), *case.plan_args, "--json", str(out / "plan.json")]
    )
    console.print(f"\n[bold]cachelane plan ({case.name})[/bold]")
    result = plan_cli.plan(args, console)
    plan_cli.print_plan(result, console)
    plan_cli.plot(result, out / "plan.png")
    (out / "plan.json").write_text(json.dumps(result, indent=2))
    (out / "output.txt").write_text(console.export_text())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.plan_cases", description=__doc__)
    p.add_argument("--duration-s", type=float, default=DURATION_S)
    p.add_argument("--cases", default=",".join(CASES), help="(default: %(default)s)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    with sigterm_as_interrupt():
        for name in args.cases.split(","):
            run_case(CASES[name], args.duration_s, args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
