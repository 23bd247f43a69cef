"""Latency-critical tenants on a busy heterogeneous fleet.

    python -m loadtest.bench.critical [--quick] [--arms no-tenants,static-pinning,...]
                                      [--duration-s N] [--seed N]

One simulated fleet of 6 replicas (2 HBM-only; 4 with a CPU offload tier and one shared remote
tier), one seeded trace of four tenants (loadtest/workloads/critical_traces.py: a voice and an agent
tenant, latency-critical, carrying about half of the prompt tokens; a chat+RAG tenant and a bulk
one-off tenant, standard) at ~0.9 of the fleet's prefill under round robin. Every arm replays the
whole trace open-loop, each request with its tenant's API key, after every replica's prefix cache
and the remote tier were emptied, through a fresh router:

  no-tenants      cachelane, no tenants: every request is alike; the fleet's two kinds of replica
                  as two unpinned pools; flow control off.
  static-pinning  cachelane, tenants with classes; the HBM-only replicas a pinned pool (admission
                  cap, lending below half of it), critical spills to the offload pool when the
                  pinned one is at its cap; flow control off.
  flow-control    static-pinning plus class-aware flow control (the config's default classes),
                  engine priority on every pool, critical placement by the cost model over both
                  pools (critical.placement: cost), standard kept off a replica where a critical
                  request is loading its KV (critical.clear_while_loading), and lending that keeps
                  a pinned replica idle and bounds the lent prefill (lend_keep_idle,
                  lend_max_prefill_tokens).
  priority        cachelane, tenants with classes, no pinned pool: the pools of no-tenants with
                  engine priority, flow control at its defaults; the cost model counts, for a
                  critical request, only the prefill in progress and critical work queued ahead
                  (it overtakes the rest); standard kept off a replica where a critical request
                  is loading its KV (critical.clear_while_loading).
  sglang, vllm    sglang-router and vllm-router, cache_aware, on the same 6 replicas (they ignore
                  the API keys).

Before the arms it prints the trace's floor: each request's own prefill with a perfect cache
and no queue (critical_traces.ideal_floor), which no router beats.

Per arm: TTFT p50/p99 per class and overall, prefix hit rate (usage cached / prompt tokens),
requests shed (503/429, and whether Retry-After came with them) and failed; where critical
requests were served and how long the engines' prefill queues were. Prints the tables and writes
results/bench_critical.json and results/bench_critical.png. Compare arms within one run: the
machine's 2 cores are shared by the client, the router and the fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich import box
from rich.console import Console
from rich.table import Table

from loadtest.bench import figures, harness, report
from loadtest.bench.peer_routers import RouterSpec, running_router
from loadtest.bench.processes import (
    gateway_from_config,
    loopback_urls,
    sim_from_config,
)
from loadtest.bench.replay import (
    RequestResult,
    Summary,
    at_offsets,
    errors_into,
    open_client,
    request_body,
    stream_into,
    summarize,
)
from loadtest.bench.report import ms
from loadtest.sim.config import ITL_S, SIM_MODEL
from loadtest.workloads import critical_traces as ct
from loadtest.workloads.traces import ServiceBound, TraceRecord
from routing import cost
from routing.whatif.summary import percentile

# --- the fleet -------------------------------------------------------------------------------

HBM_ONLY_REPLICAS = 2
OFFLOAD_REPLICAS = 4

PREFILL_TOKENS_PER_S = 4_000.0
SLOWDOWN = cost.PREFILL_TOKENS_PER_S / PREFILL_TOKENS_PER_S  # 7.5x slower than an 8B on one H200
# Why slower than an H200: the client, the router and all six simulated replicas share this
# machine's 2 cores, which drive ~15-20 streamed requests/s. The trace's ~17 requests/s keep six
# 4k-token/s replicas ~0.9 busy; six at an H200's 30k would need ~7.5x the rate, which 2 cores
# cannot send. PCIe and the remote tier's bandwidth are scaled down by the same factor, so swapping
# and fetching cost what they would next to an H200's prefill (routing/cost.py's ratios).
COSTS: dict[str, float] = {
    "prefill_tokens_per_s": PREFILL_TOKENS_PER_S,
    "pcie_gbps": round(cost.PCIE_GBPS / SLOWDOWN, 3),
    "remote_gbps": round(cost.REMOTE_GBPS / SLOWDOWN, 3),
}
HBM_TOKENS = 24_000
# Per replica: a handful of 2-10k-token agent contexts, or ~12 RAG documents. The default trace
# holds ~440k distinct prompt tokens (agent tool prompts and growing scratchpads, chat
# conversations, 40 documents, one-off bulk prompts), ~3x the fleet's HBM: prefixes are evicted,
# to the CPU tier on the offload replicas, for good on the HBM-only ones.
CPU_TOKENS = 96_000  # the offload replicas' CPU tier: 4x HBM (host RAM is several times HBM)
PINNED_MAX_PREFILL_TOKENS = 2_000  # ~0.5 s of prefill queued on a pinned replica at most
LEND_BELOW = 0.5  # standard traffic may use a pinned replica below half of its admission cap
LEND_MAX_PREFILL_TOKENS: int | None = PINNED_MAX_PREFILL_TOKENS
LEND_KEEP_IDLE = 1
# flow-control arm: a pinned replica is lent only while the other pinned replica has no prefill
# pending (lend_keep_idle: 1), so a critical request arriving next finds a pinned replica it can
# start on at once; and only to a request that prefills at most the admission cap's 2,000 tokens
# there (0.5 s at 4,000 tokens/s; a 4k-token bulk prompt would hold it for 1 s). Without a bound,
# one seed-1 run showed a lent 4k bulk prompt holding a pinned replica for 1 s in front of two
# agent steps whose context was there; with 1,000 tokens almost no standard request qualified
# (their contexts are never on the pinned replicas). docs/critical.md has the runs.

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
QUIESCE_TIMEOUT_S = 15.0  # between arms: until no replica has a request running or waiting
MAX_CONNECTIONS = 1024
HTTP_TIMEOUT_S = 5.0  # one reset or scrape on loopback

SERVICE_BOUND = ServiceBound(prefill_tokens_per_s=PREFILL_TOKENS_PER_S / 2, itl_s=ITL_S * 2)
# The next turn of a session is never sent before its previous turn could have finished at half
# the replica's speed (as bench_routing does with its fleet).

CACHELANE_ARMS = ("no-tenants", "static-pinning", "flow-control", "priority")
EXTERNAL_ARMS = {
    "sglang": RouterSpec("sglang", "cache_aware"),
    "vllm": RouterSpec("vllm", "cache_aware"),
}
# vllm-router's policies in loadtest/bench/peer_routers.py: cache_aware, round_robin,
# consistent_hash.
ARMS = (*CACHELANE_ARMS, *EXTERNAL_ARMS)
SHED_STATUSES = (429, 503)


@dataclass(frozen=True)
class Fleet:
    hbm_only: list[str]
    offload: list[str]
    remote: str

    @property
    def replicas(self) -> list[str]:
        return self.hbm_only + self.offload

    def pool_of(self, name: str) -> str:
        """`host:port` (the gateway's replica name) -> hbm-only | offload | ?"""
        if f"http://{name}" in self.hbm_only:
            return "hbm-only"
        return "offload" if f"http://{name}" in self.offload else "?"

    def reset(self) -> None:
        with httpx.Client(timeout=HTTP_TIMEOUT_S, trust_env=False) as client:
            for url in self.replicas:
                client.post(f"{url}/reset_prefix_cache").raise_for_status()
            client.post(f"{self.remote}/reset").raise_for_status()

    def quiesce(self, timeout_s: float = QUIESCE_TIMEOUT_S) -> bool:
        """Wait until no replica runs or queues a request (leftovers of the previous arm)."""
        pattern = re.compile(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$", re.M)
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=HTTP_TIMEOUT_S, trust_env=False) as client:
            while True:
                busy = sum(
                    float(v)
                    for url in self.replicas
                    for v in pattern.findall(client.get(f"{url}/metrics").text)
                )
                if busy == 0:
                    return True
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.2)


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


def sim_config(fleet: Fleet) -> dict[str, Any]:
    """The fleet as `python -m loadtest.sim --config` reads it (a gateway config's pools)."""
    sim = {"sim": {"scheduling_policy": "priority"}}  # engines may order prefill by priority
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


def gateway_config(fleet: Fleet, arm: str) -> dict[str, Any]:
    """Each arm's cachelane config: the fleet's facts, tenants and pools; defaults otherwise."""
    tiers = [{"name": "kv", "url": fleet.remote}]
    if arm in ("no-tenants", "priority"):  # the fleet's two kinds of replica, no pinned pool
        by_class = arm == "priority"
        extra: dict[str, Any] = {"engine_priority": True} if by_class else {}
        pools = [
            _pool("hbm-only", fleet.hbm_only, offload=False, hbm_only=True, **extra),
            _pool("offload", fleet.offload, offload=True, **extra),
        ]
        if not by_class:
            return {"remote_tiers": tiers, "flow_control": {"enabled": False}, "pools": pools}
        return {
            "tenants": tenants_config(),
            "critical": {"clear_while_loading": True},
            "remote_tiers": tiers,
            "pools": pools,
        }
    flow = arm == "flow-control"
    priority: dict[str, Any] = {"engine_priority": True} if flow else {}
    lending: dict[str, Any] = {"lend_keep_idle": LEND_KEEP_IDLE} if flow else {}
    if flow and LEND_MAX_PREFILL_TOKENS is not None:
        lending["lend_max_prefill_tokens"] = LEND_MAX_PREFILL_TOKENS
    pinned = _pool(
        "pinned",
        fleet.hbm_only,
        offload=False,
        pinned=True,
        hbm_only=True,
        admission={"max_prefill_tokens": PINNED_MAX_PREFILL_TOKENS},
        lend_below=LEND_BELOW,
        **priority,
        **lending,
    )
    critical: dict[str, Any] = {"fallback": "spill"}
    if flow:
        critical.update(placement="cost", clear_while_loading=True)
    return {
        "tenants": tenants_config(),
        "critical": critical,
        "flow_control": {"enabled": flow},
        "remote_tiers": tiers,
        "pools": [pinned, _pool("offload", fleet.offload, offload=True, **priority)],
    }


@contextmanager
def sim_fleet(log_dir: Path) -> Iterator[Fleet]:
    urls = loopback_urls(1 + HBM_ONLY_REPLICAS + OFFLOAD_REPLICAS)
    fleet = Fleet(urls[1 : 1 + HBM_ONLY_REPLICAS], urls[1 + HBM_ONLY_REPLICAS :], urls[0])
    with sim_from_config(sim_config(fleet), log_dir, "critical"):
        yield fleet


# --- replay ----------------------------------------------------------------------------------


@dataclass(slots=True)
class CriticalResult(RequestResult):
    tenant_class: str = ""
    retry_after: str | None = None  # the Retry-After header of a non-200 answer
    est_ttft_ms: float | None = None  # the gateway's estimate (x-cachelane-est-ttft-ms)
    fallback: str = ""  # x-cachelane-fallback: the critical request left the pinned pool

    @property
    def shed(self) -> bool:
        return self.status in SHED_STATUSES

    @property
    def failed(self) -> bool:
        return not self.ok and not self.shed


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


# --- metrics ---------------------------------------------------------------------------------

GATEWAY_FAMILIES = (
    "cachelane_critical_fallbacks",
    "cachelane_critical_routed",
    "cachelane_flow_shed",
    "cachelane_flow_wait_seconds",
    "cachelane_shed",
    "cachelane_upstream_retries",
    "cachelane_errors",
)
SIM_FAMILIES = (
    "cachelane_sim_queue_wait_seconds",
    "vllm:prompt_tokens",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_hits",
    "cachelane_sim_swap_in_tokens",
    "cachelane_sim_remote_fetch_tokens",
    "cachelane_sim_remote_recompute_tokens",
    "cachelane_sim_remote_bytes_written",
)
_KEPT_SUFFIXES = ("_total", "_sum", "_count")


def scrape(url: str, families: Sequence[str]) -> dict[str, float]:
    """Counter-like samples (_total, _sum, _count) of `families` at url/metrics, keyed by sample
    name and labels (other than model_name and engine, which every sim sets)."""
    out: dict[str, float] = {}
    with httpx.Client(timeout=HTTP_TIMEOUT_S, trust_env=False) as client:
        text = client.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name not in families:
            continue
        for sample in family.samples:
            if not sample.name.endswith(_KEPT_SUFFIXES):
                continue
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels.items()))
            out[key] = out.get(key, 0.0) + sample.value
    return out


def sim_snapshot(fleet: Fleet) -> dict[str, dict[str, float]]:
    return {url: scrape(url, SIM_FAMILIES) for url in fleet.replicas}


def pool_stats(
    fleet: Fleet,
    before: Mapping[str, Mapping[str, float]],
    after: Mapping[str, Mapping[str, float]],
    elapsed_s: float,
) -> dict[str, dict[str, float]]:
    """Per kind of replica, what its engines did during the arm: mean prefill-queue wait, share
    of their prefill capacity used, tokens swapped in and fetched."""
    out: dict[str, dict[str, float]] = {}
    for kind, urls in (("hbm-only", fleet.hbm_only), ("offload", fleet.offload)):

        def grown(name: str, urls: Sequence[str] = urls) -> float:
            return sum(after[u].get(name, 0.0) - before[u].get(name, 0.0) for u in urls)

        waits = grown("cachelane_sim_queue_wait_seconds_count")
        prompt = grown("vllm:prompt_tokens_total")
        computed = (
            prompt
            - grown("vllm:prefix_cache_hits_total")
            - grown("vllm:external_prefix_cache_hits_total")
        )
        out[kind] = {
            "prefills": waits,
            "queue_wait_mean_ms": 1000 * grown("cachelane_sim_queue_wait_seconds_sum") / waits
            if waits
            else math.nan,
            "prompt_tokens": prompt,
            "computed_tokens": computed,
            "prefill_utilisation": computed
            / (max(elapsed_s, 1e-9) * PREFILL_TOKENS_PER_S * len(urls)),
            "swap_in_tokens": grown("cachelane_sim_swap_in_tokens_total"),
            "remote_fetch_tokens": grown("cachelane_sim_remote_fetch_tokens_total"),
            "remote_recompute_tokens": grown("cachelane_sim_remote_recompute_tokens_total"),
            "remote_bytes_written": grown("cachelane_sim_remote_bytes_written_total"),
        }
    return out


# --- one arm ---------------------------------------------------------------------------------


@dataclass
class ArmResult:
    arm: str
    elapsed_s: float
    results: list[CriticalResult]
    pools: dict[str, dict[str, float]]
    gateway: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] | None = None
    quiesced: bool = True
    warmup_s: float = 0.0

    @property
    def measured(self) -> list[CriticalResult]:
        """The requests after the warm-up (every table and figure is over these)."""
        return [r for r in self.results if r.scheduled_s >= self.warmup_s]

    def group(self, name: str) -> list[CriticalResult]:
        measured = self.measured
        if name == "all":
            return measured
        if name in ct.CLASSES:
            return [r for r in measured if r.tenant_class == name]
        return [r for r in measured if r.tenant == name]

    def summary(self, name: str) -> Summary:
        return summarize(self.group(name), self.elapsed_s)

    def counts(self, name: str) -> dict[str, int]:
        rs = self.group(name)
        shed = [r for r in rs if r.shed]
        return {
            "shed": len(shed),
            "shed_with_retry_after": sum(1 for r in shed if r.retry_after is not None),
            "failed": sum(1 for r in rs if r.failed),
            "timed_out": sum(1 for r in rs if r.error and r.error.startswith("timed out")),
        }

    def placement(self, fleet: Fleet) -> dict[str, Any]:
        """Where critical requests were served (behind cachelane: its replica header), their TTFT
        there, and how much of it their own prefill explains (uncached tokens / prefill speed)."""
        out: dict[str, Any] = {}
        crit = [r for r in self.group("critical") if r.ok and r.replica]
        for kind in ("hbm-only", "offload"):
            rs = [r for r in crit if fleet.pool_of(r.replica) == kind]
            ttft = [r.ttft_s * 1000 for r in rs if r.ttft_s is not None]
            own = [1000 * (r.prompt_tokens - r.cached_tokens) / PREFILL_TOKENS_PER_S for r in rs]
            est = [r.est_ttft_ms for r in rs if r.est_ttft_ms is not None]
            out[kind] = {
                "requests": len(rs),
                "ttft_p50_ms": percentile(ttft, 50),
                "ttft_p99_ms": percentile(ttft, 99),
                "ttft_mean_ms": sum(ttft) / len(ttft) if ttft else math.nan,
                "own_prefill_mean_ms": sum(own) / len(own) if own else math.nan,
                "est_ttft_mean_ms": sum(est) / len(est) if est else math.nan,
                "hit_rate": sum(r.cached_tokens for r in rs)
                / max(1, sum(r.prompt_tokens for r in rs)),
            }
        out["fallback_spill"] = sum(1 for r in crit if r.fallback == "spill")
        std = [r for r in self.group("standard") if r.ok and r.replica]
        out["standard_on_hbm_only"] = sum(1 for r in std if fleet.pool_of(r.replica) == "hbm-only")
        return out

    def to_dict(self, fleet: Fleet) -> dict[str, Any]:
        groups = ("critical", "standard", "all", *ct.TENANTS)
        return {
            "elapsed_s": self.elapsed_s,
            "groups": {g: {**self.summary(g).to_dict(), **self.counts(g)} for g in groups},
            "critical_placement": self.placement(fleet) if self.config is not None else None,
            "pools": self.pools,
            "gateway": self.gateway,
            "quiesced_before": self.quiesced,
            "warmup_s": self.warmup_s,
            "failure_samples": sorted({r.error or "" for r in self.results if r.failed})[:5],
            "config": self.config,
        }


def run_arm(
    arm: str, fleet: Fleet, trace: Sequence[TraceRecord], log_dir: Path, warmup_s: float
) -> ArmResult:
    quiesced = fleet.quiesce()
    fleet.reset()
    before = sim_snapshot(fleet)
    config: dict[str, Any] | None = None
    gateway: dict[str, float] = {}
    if arm in CACHELANE_ARMS:
        config = gateway_config(fleet, arm)
        with gateway_from_config(config, log_dir, arm) as gw:
            started = time.perf_counter()
            results = asyncio.run(replay_trace(trace, gw.url))
            elapsed = time.perf_counter() - started
            gateway = scrape(gw.url, GATEWAY_FAMILIES)
    else:
        with running_router(EXTERNAL_ARMS[arm], fleet.replicas, log_dir) as router:
            started = time.perf_counter()
            results = asyncio.run(replay_trace(trace, router.url))
            elapsed = time.perf_counter() - started
    pools = pool_stats(fleet, before, sim_snapshot(fleet), elapsed)
    return ArmResult(arm, elapsed, results, pools, gateway, config, quiesced, warmup_s)


# --- output ----------------------------------------------------------------------------------


def results_table(arms: Mapping[str, ArmResult], not_run: Mapping[str, str]) -> Table:
    table = Table(
        title="latency-critical tenants on a busy fleet (TTFT in ms)",
        box=box.SIMPLE_HEAD,
        caption="hit: usage cached / prompt tokens; shed: 503/429 answers (with Retry-After); "
        "failed: other errors and timeouts",
    )
    columns = (
        "arm", "crit p50", "crit p99", "std p50", "std p99", "all p50", "all p99", "hit",
        "crit hit", "shed (R-A)", "failed", "ok/sent",
    )  # fmt: skip
    report.add_columns(table, columns, left=("arm",))
    for name, arm in arms.items():
        crit, std, every = arm.summary("critical"), arm.summary("standard"), arm.summary("all")
        c = arm.counts("all")
        table.add_row(
            name,
            *report.ttft_ms(crit, std, every),
            f"{every.hit_rate:.1%}",
            f"{crit.hit_rate:.1%}",
            f"{c['shed']} ({c['shed_with_retry_after']})",
            str(c["failed"]),
            f"{every.ok}/{every.requests}",
        )
    for name, why in not_run.items():
        table.add_row(name, f"[red]not run: {why[:100]}[/]", *[""] * (len(columns) - 2))
    return table


def where_table(arms: Mapping[str, ArmResult], fleet: Fleet) -> Table:
    table = Table(
        title="where the time goes: critical requests by replica kind, engines' prefill queues",
        box=box.SIMPLE_HEAD,
        caption="crit n/p50/p99: critical requests served there (cachelane's replica header) and "
        "their TTFT; own: their own uncached prefill (mean); est: the gateway's TTFT estimate "
        "(mean); queue: the engines' mean prefill-queue wait (every request); util: computed "
        "tokens / prefill capacity over the arm; swap/fetch: tokens from CPU / remote tier",
    )
    columns = (
        "arm", "replicas", "crit n", "crit p50", "crit p99", "own", "est", "queue", "util",
        "swap tok", "fetch tok",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("arm", "replicas") else "right")
    for name, arm in arms.items():
        placement = arm.placement(fleet) if arm.config is not None else {}
        for kind, p in arm.pools.items():
            where = placement.get(kind, {})
            table.add_row(
                name if kind == "hbm-only" else "",
                kind,
                str(where.get("requests", "-")),
                ms(where.get("ttft_p50_ms")),
                ms(where.get("ttft_p99_ms")),
                ms(where.get("own_prefill_mean_ms")),
                ms(where.get("est_ttft_mean_ms")),
                ms(p["queue_wait_mean_ms"]),
                f"{p['prefill_utilisation']:.0%}",
                f"{p['swap_in_tokens']:,.0f}",
                f"{p['remote_fetch_tokens']:,.0f}",
            )
    return table


def plot(path: Path, arms: Mapping[str, ArmResult], title: str) -> None:
    """TTFT p50 and p99 per class, one group of bars per arm."""
    plt = figures.pyplot()
    names = list(arms)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    width = 0.38
    colors = {"critical": "tab:red", "standard": "tab:blue"}
    for ax, (stat, label) in zip(
        axes, (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99")), strict=True
    ):
        for j, klass in enumerate(ct.CLASSES):
            values = [getattr(arms[n].summary(klass), stat) for n in names]
            values = [0.0 if math.isnan(v) else v for v in values]
            xs = [i + (j - 0.5) * width for i in range(len(names))]
            bars = ax.bar(xs, values, width, label=klass, color=colors[klass])
            ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=7)
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_title(label)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    figures.save_figure(fig, path, title=title)


# --- main ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = harness.parser(
        "critical",
        "Latency-critical tenants on a busy heterogeneous simulated fleet: cachelane "
        "without tenants, with static pinning, with flow control; sglang-router and vllm-router.",
        quick=f"{QUICK_DURATION_S:.0f} s per arm",
    )
    add = p.add_argument
    harness.add_names(p, "--arms", ARMS, "comma-separated")
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


def settings(
    duration_s: float,
    warmup_s: float,
    seed: int,
    load: ct.LoadEstimate,
    trace: Sequence[TraceRecord],
) -> dict[str, Any]:
    return {
        "duration_s": duration_s,
        "warmup_s": warmup_s,
        "seed": seed,
        "requests": len(trace),
        "measured_requests": sum(1 for r in trace if r["t_s"] >= warmup_s),
        "rates_per_s": ct.Mix().rates_per_s,
        "tenants": {t.name: t.tenant_class for t in ct.TENANTS.values()},
        "load": load.to_dict(),
        "fleet": {
            "hbm_only_replicas": HBM_ONLY_REPLICAS,
            "offload_replicas": OFFLOAD_REPLICAS,
            "hbm_capacity_tokens": HBM_TOKENS,
            "cpu_capacity_tokens_offload": CPU_TOKENS,
            "costs": COSTS,
            "itl_s": ITL_S,
            "scheduling_policy": "priority",
        },
        "request_timeout_s": REQUEST_TIMEOUT_S,
        "source": _source_state(),
    }


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


def run_one(
    console: Console,
    arm: str,
    fleet: Fleet,
    trace: Sequence[TraceRecord],
    log_dir: Path,
    warmup_s: float,
    done: dict[str, ArmResult],
    not_run: dict[str, str],
) -> None:
    """Run one arm into `done`, or say in `not_run` why it did not run; print its line."""
    result = harness.try_arm(
        console, arm, not_run, lambda: run_arm(arm, fleet, trace, log_dir, warmup_s)
    )
    if result is None:
        return
    done[arm] = result
    report.write_results_jsonl(log_dir / f"{arm}-requests.jsonl", result.results)
    crit, std, c = result.summary("critical"), result.summary("standard"), result.counts("all")
    console.print(
        f"  {arm:<15} critical TTFT p50 {ms(crit.ttft_p50_ms):>6} p99 "
        f"{ms(crit.ttft_p99_ms):>6} ms  standard p50 {ms(std.ttft_p50_ms):>6} "
        f"p99 {ms(std.ttft_p99_ms):>6} ms  shed {c['shed']}  failed {c['failed']}"
        f"  ({result.elapsed_s:.0f} s)"
    )


def describe_trace(
    console: Console, trace: Sequence[TraceRecord], warmup_s: float, total_s: float
) -> tuple[ct.LoadEstimate, ct.Floor]:
    """Print what the trace asks of the fleet and the floor no router beats; return both."""
    shapes = [ct.ReplicaShape(HBM_TOKENS, 0, False, PREFILL_TOKENS_PER_S)] * HBM_ONLY_REPLICAS
    shapes += [ct.ReplicaShape(HBM_TOKENS, CPU_TOKENS, True, PREFILL_TOKENS_PER_S)] * (
        OFFLOAD_REPLICAS
    )
    load = ct.round_robin_load(trace, shapes, total_s, model=SIM_MODEL)
    console.print(
        f"{len(trace)} requests over {total_s:.0f} s ({len(trace) / total_s:.1f}/s; the first "
        f"{warmup_s:.0f} s warm the caches and are not counted): "
        + ", ".join(f"{t} {n}" for t, n in sorted(load.requests.items()))
        + f"; critical tenants carry {load.critical_token_share:.0%} of "
        f"{load.total_prompt_tokens:,} prompt tokens\n"
        f"estimated prefill utilisation of the fleet ({len(shapes)} x "
        f"{PREFILL_TOKENS_PER_S:,.0f} tokens/s): {load.rr_utilisation:.2f} under round robin "
        f"(HBM/CPU/remote reuse as the simulator keeps it), {load.raw_utilisation:.2f} without "
        "any cache"
    )
    floor = ct.ideal_floor(trace, PREFILL_TOKENS_PER_S, model=SIM_MODEL, since_s=warmup_s)
    console.print(
        "floor (perfect cache, no queue; no router beats it): TTFT p50 / p99 "
        + ", ".join(
            f"{g} {ms(floor.p(g, 50))} / {ms(floor.p(g, 99))} ms" for g in (*ct.CLASSES, "all")
        )
    )
    return load, floor


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = harness.console(width=150)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        console.print(f"[red]bench_critical: unknown arms {unknown}; known: {', '.join(ARMS)}")
        return 2
    duration_s = args.duration_s or (QUICK_DURATION_S if args.quick else DURATION_S)
    warmup_s = (
        args.warmup_s if args.warmup_s is not None else (QUICK_WARMUP_S if args.quick else WARMUP_S)
    )
    total_s = warmup_s + duration_s
    out: Path = args.out
    log_dir = harness.log_dir(out)

    trace = ct.critical_trace(ct.Mix(), total_s, args.seed, SERVICE_BOUND)
    load, floor = describe_trace(console, trace, warmup_s, total_s)

    not_run: dict[str, str] = {}
    for arm in arms:
        if arm in EXTERNAL_ARMS:
            error = harness.peer_router_error(console, EXTERNAL_ARMS[arm].kind)
            if error:
                not_run[arm] = error

    started = time.perf_counter()
    done: dict[str, ArmResult] = {}
    fleets: list[Fleet] = []

    def run_arms() -> None:
        with sim_fleet(log_dir) as fleet:
            fleets.append(fleet)
            for arm in arms:
                if arm not in not_run:
                    run_one(console, arm, fleet, trace, log_dir, warmup_s, done, not_run)

    # RuntimeError out of run_arms: the sim fleet did not start (an arm's own is caught by it)
    code = harness.run_arms(console, "bench_critical", run_arms)
    if code:
        return code
    wall_s = time.perf_counter() - started
    fleet = fleets[0]
    console.print(results_table(done, not_run))
    if done:
        console.print(where_table(done, fleet))
    payload = {
        "settings": settings(duration_s, warmup_s, args.seed, load, trace),
        "floor": floor.to_dict(),
        "arms": {name: arm.to_dict(fleet) for name, arm in done.items()},
        "not_run": not_run,
        "wall_time_s": wall_s,
    }
    title = (
        f"latency-critical tenants, {duration_s:.0f} s per arm after a {warmup_s:.0f} s warm-up "
        "(simulated fleet)"
    )
    harness.write_results(
        console, out, payload, lambda png: plot(png, done, title), wall_s, log_dir
    )
    return 1 if any(a in not_run for a in CACHELANE_ARMS if a in arms) else 0


if __name__ == "__main__":
    sys.exit(main())
