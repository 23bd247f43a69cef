"""The simulated fleet of loadtest/bench/critical.py: its replicas and speeds, how its engines
schedule prefill (ENGINES), and what the engines did during an arm (from their metrics)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.bench.critical_results import ArmResult
from loadtest.sim.config import MAX_MODEL_LEN_TOKENS
from loadtest.sim.fleet import step_flags
from loadtest.sim.steps import StepSettings, default_max_num_batched_tokens
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

# --- the engines -----------------------------------------------------------------------------

THRESHOLD_TOKENS = round(
    0.04 * MAX_MODEL_LEN_TOKENS * PREFILL_TOKENS_PER_S / cost.PREFILL_TOKENS_PER_S
)
# The `threshold` engine's --long-prefill-token-threshold: 699 tokens. vLLM's own figure when it
# sets one (vllm/config/scheduler.py, SchedulerConfig: with max_num_partial_prefills > 1 and no
# threshold given, int(max_model_len * 0.04); 5,242 tokens for Llama-3.1-8B's 131,072), scaled to
# the fleet's prefill rate as the step budget is (steps.default_max_num_batched_tokens): 0.64 of
# the 1,092-token budget, so a long prefill leaves 393 tokens of every step to the others.


@dataclass(frozen=True, slots=True)
class Engine:
    """How every simulated replica schedules prefill: the sim's engine flags."""

    name: str
    model: Literal["steps", "serial"] = "steps"
    long_prefill_token_threshold: int = 0
    scheduling_policy: cost.SchedulingPolicy = "priority"
    # what the cachelane pools declare of it: every flag (docs/critical.md's set-up), or the
    # policy alone (a user who set none of the others: the cost model takes vLLM's defaults)
    flags_declared: bool = True

    def step_settings(self) -> StepSettings | None:
        """The step loop's settings (None: the one-at-a-time engine): vLLM's defaults, the budget
        scaled to the fleet's prefill rate, the engine's scheduling policy."""
        if self.model == "serial":
            return None
        return StepSettings(
            prefill_tokens_per_s=PREFILL_TOKENS_PER_S,
            max_num_batched_tokens=default_max_num_batched_tokens(PREFILL_TOKENS_PER_S),
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            scheduling_policy=self.scheduling_policy,
        )

    def sim_args(self) -> list[str]:
        """Every flag given explicitly, so the fleet runs exactly what step_settings() says."""
        s = self.step_settings()
        if s is None:
            return ["--engine-model", "serial", "--scheduling-policy", self.scheduling_policy]
        return step_flags(s)

    def declared(self) -> dict[str, Any]:
        """The flags the replicas run, by vLLM's names: the pools' `engine:` block as
        docs/critical.md's set-up has it (pool_engine). The serial engine has no step budget:
        only its policy (the cost model then takes a prompt in one step of vLLM's default
        budget, whole)."""
        s = self.step_settings()
        if s is None:
            return {"scheduling_policy": self.scheduling_policy}
        return {
            "scheduling_policy": s.scheduling_policy,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "long_prefill_token_threshold": s.long_prefill_token_threshold,
            "max_num_seqs": s.max_num_seqs,
        }

    def pool_engine(self) -> dict[str, Any]:
        """The pools' `engine:` block: every flag (declared()), or the policy alone."""
        if self.flags_declared:
            return self.declared()
        return {"scheduling_policy": self.scheduling_policy}

    def to_dict(self) -> dict[str, Any]:
        """The results' record: the flags (declared()), with the model and the step's cost, and
        what the pools declared of them."""
        s = self.step_settings()
        overhead = {} if s is None else {"step_overhead_ms": s.step_overhead_s * 1000}
        declared = {"pools_declare": "flags" if self.flags_declared else "policy"}
        return {"engine_model": self.model, **self.declared(), **overhead, **declared}


ENGINES = {
    e.name: e
    for e in (
        Engine("default"),
        Engine("threshold", long_prefill_token_threshold=THRESHOLD_TOKENS),
        Engine("serial", model="serial"),
        Engine("fcfs", scheduling_policy="fcfs"),
    )
}
# `fcfs`: the default engine on vLLM's default policy, where the gateway sends no priority, so
# lent work queued on a pinned replica is served before a critical request that joins it.

HTTP_TIMEOUT_S = 5.0  # one scrape on loopback


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


# --- where critical requests went ----------------------------------------------------------


def placement(arm: ArmResult, fleet: Fleet) -> dict[str, Any] | None:
    """Where critical requests were served (behind cachelane: its replica header), their TTFT
    there, and how much of it their own prefill explains (uncached tokens / prefill speed)."""
    if arm.config is None:
        return None
    out: dict[str, Any] = {}
    crit = [r for r in arm.group("critical") if r.ok and r.replica]
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
            "hit_rate": sum(r.cached_tokens for r in rs) / max(1, sum(r.prompt_tokens for r in rs)),
        }
    out["fallback_spill"] = sum(1 for r in crit if r.fallback == "spill")
    std = [r for r in arm.group("standard") if r.ok and r.replica]
    out["standard_on_hbm_only"] = sum(1 for r in std if fleet.pool_of(r.replica) == "hbm-only")
    return out
