"""`python -m loadtest.bench.costs`: the gateway's cost accounting against the simulator's truth.

A simulated fleet (2 replicas with a CPU tier, one shared remote tier, `remote_write: always`)
behind a real gateway, both from one config file; a seeded three-tenant trace
(loadtest/workloads/cost_traces.py) replayed open loop. Then, side by side: what the gateway's
GET /debug/costs says (summed over its rows) and what the simulator counted (its replicas' and
remote tier's /metrics, and each request's usage.cachelane_sim), and finally `cachelane report`
on the live gateway. docs/costs.md shows a run.

    python -m loadtest.bench.costs                       # ~40 s: 300 requests at 8 req/s
    python -m loadtest.bench.costs --requests 80 --png results/costs.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.bench.replay import at_offsets, request_body, sse_chunks
from loadtest.sim.config import SIM_MODEL
from loadtest.sim.protocol import SIM_TIMING_KEY
from loadtest.workloads.cost_traces import TENANT_CLASSES, cost_trace
from loadtest.workloads.traces import TraceRecord
from routing.cost import KV_BYTES_PER_TOKEN, PoolCosts
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS

ADMIN_KEY = (
    "bench-admin-key-" + "0" * 32
)  # keys have at least 32 characters (gateway/tenancy/keys.py)
TENANT_KEYS = {name: f"bench-{name}-key-" + "0" * 32 for name in TENANT_CLASSES}
REQUEST_TIMEOUT_S = 60.0  # one streamed request on a loaded 2-core machine, with margin
BLOCK_BYTES = DEFAULT_BLOCK_SIZE_TOKENS * KV_BYTES_PER_TOKEN


@dataclass(frozen=True)
class FleetShape:
    """The simulated fleet. Capacities are small so a short run fills every tier: the agents'
    documents (~12k tokens) do not fit one replica's HBM, and the remote tier evicts."""

    replicas: int = 2
    hbm_capacity_tokens: int = 6_000
    cpu_capacity_tokens: int = 8_000
    remote_capacity_tokens: int = 24_000
    remote_write: str = "always"
    itl_s: float = 0.002  # short answers: the accounting is about the prompt
    pcie_gbps: float = PoolCosts().pcie_gbps  # lower it to put swap-ins under PCIe pressure

    def config(self, replica_urls: Sequence[str], remote_url: str) -> dict[str, Any]:
        """One file for the gateway and `cachelane sim --config`: capacities, tenants, admin."""
        return {
            "routing": {"policy": "cache_aware"},
            "engine_metrics": {"enabled": False},
            "health": {"interval_s": 0.5, "timeout_s": 1.0, "fail_after": 2},
            "admin": {"api_key": ADMIN_KEY},
            "tenants": [
                {"name": name, "api_key": TENANT_KEYS[name], "class": klass}
                for name, klass in TENANT_CLASSES.items()
            ],
            "remote_tiers": [
                {"name": "kv", "url": remote_url, "capacity_tokens": self.remote_capacity_tokens}
            ],
            "pools": [
                {
                    "name": "offload",
                    "models": [SIM_MODEL],
                    "replicas": list(replica_urls),
                    "hbm_capacity_tokens": self.hbm_capacity_tokens,
                    "cpu_capacity_tokens": self.cpu_capacity_tokens,
                    "remote_tier": "kv",
                    "remote_write": self.remote_write,
                    "costs": {"pcie_gbps": self.pcie_gbps},
                    "sim": {"itl_s": self.itl_s},
                }
            ],
        }


@dataclass
class Outcome:
    tenant: str
    status: int = 0
    ttft_s: float | None = None
    est_terms_ms: dict[str, float] = field(default_factory=dict)
    sim: dict[str, float] = field(default_factory=dict)  # the simulator's usage extension
    error: str | None = None


def parse_terms(header: str) -> dict[str, float]:
    """x-cachelane-est-terms-ms: "fixed=3.0,load=0.0,queue=12.5,prefill=40.1"."""
    out = {}
    for part in header.split(","):
        name, _, value = part.partition("=")
        if name and value:
            out[name.strip()] = float(value)
    return out


async def send_trace(
    trace: Sequence[TraceRecord], gateway_url: str, keys: Mapping[str, str], max_in_flight: int
) -> list[Outcome]:
    """Replay `trace` open loop (each record at its offset), each with its tenant's key."""
    outcomes = [Outcome(r["tenant"]) for r in trace]
    slots = asyncio.Semaphore(max_in_flight)
    limits = httpx.Limits(max_connections=max_in_flight)
    async with httpx.AsyncClient(
        base_url=gateway_url, timeout=REQUEST_TIMEOUT_S, limits=limits
    ) as client:

        async def one(i: int, record: TraceRecord, _due_s: float) -> None:
            out = outcomes[i]
            headers = {"authorization": f"Bearer {keys[record['tenant']]}"}
            body = request_body(record, SIM_MODEL)
            try:
                async with slots:
                    started = time.perf_counter()
                    async with client.stream(
                        "POST", "/v1/chat/completions", json=body, headers=headers
                    ) as resp:
                        out.status = resp.status_code
                        out.est_terms_ms = parse_terms(
                            resp.headers.get("x-cachelane-est-terms-ms", "")
                        )
                        if resp.status_code != 200:
                            out.error = (await resp.aread()).decode(errors="replace")[:200]
                            return
                        async for chunk in sse_chunks(resp):
                            if out.ttft_s is None and chunk.get("choices"):
                                out.ttft_s = time.perf_counter() - started
                            usage = chunk.get("usage")
                            if usage and SIM_TIMING_KEY in usage:
                                out.sim = usage[SIM_TIMING_KEY]
            except (httpx.HTTPError, ValueError) as err:
                out.error = f"{type(err).__name__}: {err}"

        await at_offsets(trace, one, drain_timeout_s=REQUEST_TIMEOUT_S)
    return outcomes


async def scrape_sums(client: httpx.AsyncClient, urls: Sequence[str]) -> dict[str, float]:
    """Every sample of every URL's /metrics, summed by sample name over the URLs."""
    sums: dict[str, float] = {}
    for url in urls:
        resp = await client.get(f"{url}/metrics")
        resp.raise_for_status()
        for family in text_string_to_metric_families(resp.text):
            for sample in family.samples:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


async def debug_costs(
    client: httpx.AsyncClient, gateway_url: str, window_s: float = 3600.0
) -> dict[str, Any]:
    resp = await client.get(
        f"{gateway_url}/debug/costs",
        params={"window_s": window_s},
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    )
    resp.raise_for_status()
    window: dict[str, Any] = resp.json()["windows"][0]
    return window


def gateway_totals(window: Mapping[str, Any]) -> dict[str, float]:
    """A /debug/costs window summed over its rows (and its pools' HBM evictions)."""
    totals: dict[str, float] = {}
    for row in window["rows"]:
        for name, value in row["sums"].items():
            totals[name] = totals.get(name, 0.0) + value
    totals["hbm_evicted_blocks"] = sum(p["hbm_evicted_blocks"] for p in window["pools"])
    return totals


@dataclass(frozen=True)
class Check:
    quantity: str
    gateway: float
    simulator: float
    kind: str  # "exact": the gateway reads it from the engine; "estimate": it infers it

    @property
    def ratio(self) -> float | None:
        return self.gateway / self.simulator if self.simulator else None


def checks(
    gw: Mapping[str, float],
    replicas: Mapping[str, float],
    remote: Mapping[str, float],
    outcomes: Sequence[Outcome],
) -> list[Check]:
    """The gateway's sums next to the simulator's own counters, quantity by quantity."""
    timed = [o for o in outcomes if o.status == 200 and o.ttft_s is not None]
    sim_queue_s = sum(o.sim.get("queue_wait_ms", 0.0) for o in timed) / 1000
    queue = queue_rules(timed)
    r, t = replicas, remote
    return [
        Check("streamed requests", gw["timed_requests"], len(timed), "exact"),
        Check("prompt tokens", gw["prompt_tokens"], r["vllm:prompt_tokens_total"], "exact"),
        Check(
            "cached tokens",
            gw["cached_tokens"],
            r["vllm:prefix_cache_hits_total"] + r["vllm:external_prefix_cache_hits_total"],
            "exact",
        ),
        Check("HBM-hit tokens", gw["hbm_tokens"], r["vllm:prefix_cache_hits_total"], "estimate"),
        Check(
            "CPU-tier tokens (PCIe)",
            gw["cpu_tokens"],
            r["cachelane_sim_swap_in_tokens_total"],
            "estimate",
        ),
        Check("swap-ins", gw["swap_ins"], r["cachelane_sim_swap_ins_total"], "estimate"),
        Check(
            "swap-ins sharing the link (sum)",
            gw["swap_link_sharers"],
            r["cachelane_sim_swap_link_sharers_total"],
            "estimate",
        ),
        Check(
            "remote-tier tokens fetched",
            gw["remote_tokens"],
            r["cachelane_sim_remote_fetch_tokens_total"],
            "estimate",
        ),
        Check(
            "remote bytes written",
            gw["remote_written_bytes"],
            r["cachelane_sim_remote_bytes_written_total"],
            "estimate",
        ),
        Check(
            "remote bytes evicted",
            gw["remote_evicted_bytes"],
            t["cachelane_sim_remote_tier_evicted_blocks_total"] * BLOCK_BYTES,
            "estimate",
        ),
        Check(
            "remote bytes evicted never read",
            gw["remote_never_read_bytes"],
            t["cachelane_sim_remote_tier_evicted_unread_blocks_total"] * BLOCK_BYTES,
            "estimate",
        ),
        Check(
            "HBM blocks evicted",
            gw["hbm_evicted_blocks"],
            r["cachelane_sim_hbm_evicted_blocks_total"],
            "estimate",
        ),
        Check(
            "prefill GPU-s avoided (sim: cached tokens / its prefill rate)",
            sum(gw[f"avoided_{tier}_s"] for tier in ("hbm", "cpu", "remote")),
            (r["vllm:prefix_cache_hits_total"] + r["vllm:external_prefix_cache_hits_total"])
            / PoolCosts().prefill_tokens_per_s,
            "estimate",
        ),
        Check("queue s (gateway: proportional rule)", gw["queue_s"], sim_queue_s, "estimate"),
        Check("queue s (residual rule, client-side)", queue.residual_s, sim_queue_s, "estimate"),
        Check(
            "queue: mean abs error per request, ms (proportional, client-side)",
            queue.proportional_mae_ms,
            0.0,
            "estimate",
        ),
        Check(
            "queue: mean abs error per request, ms (residual, client-side)",
            queue.residual_mae_ms,
            0.0,
            "estimate",
        ),
    ]


@dataclass(frozen=True)
class QueueRules:
    residual_s: float
    residual_mae_ms: float
    proportional_mae_ms: float


def queue_rules(timed: Sequence[Outcome]) -> QueueRules:
    """The two attribution rules applied client-side, per request, to the estimate's terms (the
    x-cachelane-est-terms-ms header) and the client's TTFT, against the simulator's queue wait:
    proportional (every term scaled by observed / estimated: what the gateway does, there on
    the tokens the engine confirmed) and residual (the queue is observed - the other terms)."""
    residual_s, residual_err, proportional_err = 0.0, [], []
    for o in timed:
        terms, sim_ms = o.est_terms_ms, o.sim.get("queue_wait_ms")
        est_ms = sum(terms.values())
        if o.ttft_s is None or sim_ms is None or est_ms <= 0:
            continue
        obs_ms = 1000 * o.ttft_s
        residual_ms = max(0.0, obs_ms - (est_ms - terms.get("queue", 0.0)))
        residual_s += residual_ms / 1000
        residual_err.append(abs(residual_ms - sim_ms))
        proportional_err.append(abs(terms.get("queue", 0.0) * obs_ms / est_ms - sim_ms))
    n = max(1, len(residual_err))
    return QueueRules(residual_s, sum(residual_err) / n, sum(proportional_err) / n)


def check_table(rows: Sequence[Check]) -> str:
    lines = [
        "| quantity | gateway | simulator | gateway / simulator | |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for c in rows:
        ratio = "-" if c.ratio is None else f"{c.ratio:.3f}"
        lines.append(
            f"| {c.quantity} | {c.gateway:,.1f} | {c.simulator:,.1f} | {ratio} | {c.kind} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.costs", description=__doc__)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-in-flight", type=int, default=32)
    parser.add_argument("--out-dir", type=Path, default=Path("results/bench_costs"))
    parser.add_argument("--png", type=Path, default=None, help="cachelane report's chart")
    parser.add_argument("--remote-write", choices=("always", "reuse", "never"), default="always")
    parser.add_argument(
        "--pcie-gbps", type=float, default=PoolCosts().pcie_gbps, help="the CPU tier's link"
    )
    return parser


async def _measure(
    args: argparse.Namespace, gateway_url: str, replica_urls: Sequence[str], remote_url: str
) -> dict[str, Any]:
    trace = cost_trace(args.requests, args.rate, seed=args.seed)
    started = time.monotonic()
    outcomes = await send_trace(trace, gateway_url, TENANT_KEYS, args.max_in_flight)
    wall_s = time.monotonic() - started
    await asyncio.sleep(0.5)  # the last remote writes run beside the last answers
    async with httpx.AsyncClient(timeout=10.0) as client:
        window = await debug_costs(client, gateway_url)
        replicas = await scrape_sums(client, replica_urls)
        remote = await scrape_sums(client, [remote_url])
    rows = checks(gateway_totals(window), replicas, remote, outcomes)
    return {
        "requests": len(trace),
        "errors": sum(1 for o in outcomes if o.status != 200 or o.error),
        "wall_s": round(wall_s, 1),
        "checks": [asdict(c) | {"ratio": c.ratio} for c in rows],
        "table": check_table(rows),
        "debug_costs": window,
    }


def main(argv: Sequence[str] | None = None) -> int:
    from loadtest.bench.processes import (
        gateway_from_config,
        loopback_urls,
        sigterm_as_interrupt,
        sim_from_config,
    )

    args = build_parser().parse_args(argv)
    shape = FleetShape(remote_write=args.remote_write, pcie_gbps=args.pcie_gbps)
    urls = loopback_urls(shape.replicas + 1)
    replica_urls, remote_url = urls[:-1], urls[-1]
    config = shape.config(replica_urls, remote_url)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with (
        sigterm_as_interrupt(),
        sim_from_config(config, args.out_dir, "costs"),
        gateway_from_config(config, args.out_dir, "costs") as gw,
    ):
        result = asyncio.run(_measure(args, gw.url, replica_urls, remote_url))
        print(result["table"])
        print(f"\n{result['requests']} requests, {result['errors']} errors, {result['wall_s']} s")
        report = [
            sys.executable, "-m", "gateway", "report", gw.url,
            "--admin-key", ADMIN_KEY, "--window", "15m",
        ]  # fmt: skip
        if args.png is not None:
            report += ["--png", str(args.png)]
        done = subprocess.run(report, capture_output=True, text=True, timeout=60, check=False)
        print(done.stdout, done.stderr, sep="")
        result["report"] = done.stdout
    (args.out_dir / "costs.json").write_text(json.dumps(result, indent=2))
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
