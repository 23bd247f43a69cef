"""The tier cost model: estimated time to first token of a request on one replica.

    est_ttft = t_fixed + t_queue + t_swap + t_remote + t_prefill

    t_fixed   = per-request overhead outside the prefill (HTTP, tokenizing)
    t_swap    = CPU-tier tokens * (1 + swap-ins sharing PCIe) * s per swapped token
    t_remote  = min(remote fixed cost + remote tokens * s per fetched token,
                    remote tokens * s per prefill token)      # fetch only when it beats recompute
    t_queue   = from the moment the request's KV is loaded (t_swap + t_remote after it is sent)
                to the start of the engine step that schedules its first chunk
    t_prefill = its own steps: each a forward pass (s per step) plus every token computed in it
                (its own, those of the prefills and decodes sharing the step) * s per token

The queue and the prefill follow vLLM V1's step loop, from the pool's declared engine flags
(`EngineSettings`, named as vLLM's): routing/prefill_steps.py says how.

KV loads do not hold the prefill: a request whose KV is still arriving from a connector waits in
WAITING_FOR_REMOTE_KVS, keeps its place and is skipped meanwhile, so a load overlaps the queue
ahead instead of adding to it. `max_num_seqs` bounds the decodes that share a step (a request
that finds every seat taken waits for a decode to end, which the gateway cannot foresee: not
modelled).

The per-token and per-step costs are `CostTerms`: seeded from a pool's configured constants
(`PoolCosts`, whose defaults describe Llama-3.1-8B in BF16 on one H200) and then fitted per
replica from observed TTFTs (routing/learn.py), since fleets differ from any default by 10-100x.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal, NamedTuple

from routing.prefill_steps import decode_step_rest_s, schedule

SchedulingPolicy = Literal["fcfs", "priority"]

KV_BYTES_PER_TOKEN = 131_072
# Llama-3.1-8B, BF16: 32 layers * 8 KV heads * 128 head dim * 2 (K and V) * 2 bytes = 128 KiB
# (meta-llama/Llama-3.1-8B config.json: num_hidden_layers=32, num_key_value_heads=8, head_dim=128).

PREFILL_TOKENS_PER_S = 30_000.0
# ~30k prompt tokens/s for an 8B model on one H200: vLLM prefill-only throughput benchmarks for
# Llama-3.1-8B on H100/H200 report 25-35k tokens/s. A seed: the fit (routing/learn.py) replaces it.

PCIE_GBPS = 50.0
# Host-to-device copy on PCIe Gen5 x16: 63 GB/s theoretical (32 GT/s x 16 lanes, 128b/130b, PCIe
# 5.0 base specification); ~50 GB/s is the ~80% that pinned-memory copies typically reach.

REMOTE_GBPS = 24.0
# 400 Gb/s RDMA NIC: 50 GB/s line rate, ~24 GB/s effective for KV transfers (Mooncake / LMCache
# remote-backend figures; an estimate until the fit measures it).

REMOTE_FIXED_S = 0.026
# ~26 ms fixed cost per remote fetch (lookup + connection + first byte): an assumption, not
# fitted (routing/learn.py fits the per-token fetch cost only).

MAX_NUM_BATCHED_TOKENS = 8_192
MAX_NUM_SEQS = 1_024
# vLLM 0.32.0, vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults: for the OpenAI API server
# (UsageContext.OPENAI_API_SERVER) on a GPU with 70-160 GiB that is not an A100 (H100, H200),
# max_num_batched_tokens 8192 and max_num_seqs 1024 (>= 160 GiB: 16384 and 1024; other GPUs: 2048
# and 256; CPU: 2048 and 128): the defaults of the H200 the other constants here describe.

LONG_PREFILL_TOKEN_THRESHOLD = 0
# vLLM 0.32.0, vllm/config/scheduler.py, SchedulerConfig.long_prefill_token_threshold = 0 (off).

SCHEDULING_POLICY: SchedulingPolicy = "fcfs"
# vLLM 0.32.0, vllm/config/scheduler.py, SchedulerConfig.policy = "fcfs".

STEP_S = 0.0034
# What an engine step costs whatever its tokens: every forward pass reads all the weights from
# HBM once, 16.06 GB (Llama-3.1-8B, 8.03e9 parameters * 2 bytes in BF16) / 4.8 TB/s (H200 HBM3e,
# NVIDIA datasheet) = 3.4 ms. A lower bound (launch and sampling add to it): the fit learns it.

FIXED_S = 0.003
# Per-request overhead outside the prefill: ~3 ms measured on this project's loopback set-up
# (loadtest/bench/overhead.py: the gateway adds ~2 ms, the replica's HTTP + JSON ~1 ms). Real
# engines add tokenization and scheduling; the fit learns their figure.

HBM_CAPACITY_TOKENS = 800_000
# Llama-3.1-8B BF16 on one H200: 141 GB HBM (NVIDIA H200 datasheet) * 0.9 (vLLM's default
# gpu_memory_utilization) - 16.1 GB of weights (8.03e9 parameters * 2 bytes) - ~5 GB for the
# profiled activation peak and CUDA graphs (an estimate) = ~105 GB, / 128 KiB per token = ~0.8M.


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """A pool's engine scheduler flags, named as vLLM's (`--max-num-batched-tokens`, ...)."""

    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    long_prefill_token_threshold: int = LONG_PREFILL_TOKEN_THRESHOLD  # 0: no cap
    scheduling_policy: SchedulingPolicy = SCHEDULING_POLICY
    max_num_seqs: int = MAX_NUM_SEQS


@dataclass(frozen=True, slots=True)
class PoolCosts:
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN
    prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S
    pcie_gbps: float = PCIE_GBPS
    remote_gbps: float = REMOTE_GBPS
    remote_fixed_s: float = REMOTE_FIXED_S
    fixed_s: float = FIXED_S
    step_s: float = STEP_S
    engine: EngineSettings = field(default_factory=EngineSettings)


@dataclass(frozen=True, slots=True)
class CostTerms:
    """The cost model's linear terms for one replica: seeded from its pool's constants, then
    fitted (routing/learn.py). `samples` is how many observations the fit has folded in."""

    fixed_s: float
    prefill_s_per_token: float
    swap_s_per_token: float  # with the PCIe link to itself
    fetch_s_per_token: float
    step_s: float = STEP_S  # an engine step's forward pass, whatever its tokens
    samples: int = 0

    @classmethod
    def seed(cls, costs: PoolCosts) -> CostTerms:
        return cls(
            fixed_s=costs.fixed_s,
            prefill_s_per_token=1.0 / costs.prefill_tokens_per_s,
            swap_s_per_token=costs.kv_bytes_per_token / (costs.pcie_gbps * 1e9),
            fetch_s_per_token=costs.kv_bytes_per_token / (costs.remote_gbps * 1e9),
            step_s=costs.step_s,
        )

    def as_vector(self) -> tuple[float, float, float, float, float]:
        return (
            self.fixed_s,
            self.prefill_s_per_token,
            self.swap_s_per_token,
            self.fetch_s_per_token,
            self.step_s,
        )

    def scaled(self, factor: float) -> CostTerms:
        """Every term `factor` times slower (the bounded-correction baseline)."""
        f = factor
        return CostTerms(
            self.fixed_s * f,
            self.prefill_s_per_token * f,
            self.swap_s_per_token * f,
            self.fetch_s_per_token * f,
            self.step_s * f,
            samples=self.samples,
        )


class Queued(NamedTuple):
    """A request sent to the replica and not yet past its first token. A NamedTuple, as Overlap
    and Estimate below: the registry builds one per request waiting on each candidate per
    decision (16 a candidate at the floor benchmark's 32 in flight over 2 replicas), and in a
    py-spy profile of that benchmark the frozen dataclass's __init__ was ~3% of the gateway's
    CPU."""

    joins_in_s: float  # when its KV is loaded and it waits for the prefill, from now (<= 0: it is)
    tokens: int  # uncached tokens it prefills
    priority: int | None = None  # the engine priority it was sent with (lower first); None: none


@dataclass(frozen=True, slots=True)
class Load:
    """What a replica is busy with, as the gateway sees it at decision time."""

    in_flight: int = 0  # requests sent and not finished
    pending_prefill_tokens: int = 0  # uncached prompt tokens sent and not yet past first token
    swaps_in_flight: int = 0  # requests still swapping KV in from the CPU tier
    busy_s: float = 0.0  # how long the replica has been prefilling the head of its queue
    # The requests behind pending_prefill_tokens whose load time is known, in any order; the rest
    # of pending_prefill_tokens (sent by other gateways, or callers that do not say) counts as
    # waiting for the prefill now.
    queue: tuple[Queued, ...] = ()
    # The engine's steps as seen on its streams (vLLM gives every decoding request a token per
    # step): how long ago the last one ended (None: not seen), how long a step of decodes alone
    # lasts there (0: not measured, or nothing decodes), and for how long its streams decode at
    # most (from their max_tokens; inf: unbounded).
    step_ended_ago_s: float | None = None
    decode_step_s: float = 0.0
    decodes_for_s: float = 0.0


class Overlap(NamedTuple):
    """How a request's prompt of `prompt_tokens` splits on one replica, in tokens.

    Overlap and Estimate are NamedTuples rather than frozen dataclasses: decide() builds one of
    each per candidate per request, and a tuple is built ~3x faster (a frozen dataclass sets each
    field through object.__setattr__)."""

    prompt_tokens: int
    hbm_tokens: int = 0
    cpu_tokens: int = 0
    remote_tokens: int = 0

    @property
    def uncached_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.hbm_tokens - self.cpu_tokens - self.remote_tokens)

    @property
    def cached_tokens(self) -> int:
        return self.prompt_tokens - self.uncached_tokens


class Estimate(NamedTuple):
    fixed_s: float
    queue_s: float
    swap_s: float
    remote_s: float
    prefill_s: float
    remote_fetch: bool  # True when fetching from the remote tier beats recomputing those tokens
    # the tokens computed in the steps up to its first token other than its own uncached ones:
    # the work ahead, the prefills and decodes sharing its steps (the fit's input, with `steps`)
    queue_tokens: float = 0.0
    swap_tokens: float = 0.0  # CPU-tier tokens x (1 + swap-ins sharing PCIe) (t_swap's input)
    overtakes: int = 0  # queued requests of a less urgent engine priority it would go before
    cuts_in_s: float = 0.0  # the wait its prefill adds to known requests joining during it
    own_s: float = 0.0  # what its own tokens add to the steps it is in (uncached x s per token)
    steps: float = 0.0  # engine steps until its first token: those it waits for, then its own
    prefill_steps: int = 1  # its own steps (from its first chunk to its last)
    # the part of queue_s that is the rest of a decode step under way (measured, not learned)
    step_wait_s: float = 0.0

    @property
    def load_s(self) -> float:
        """Time to load the request's KV (swap-in, remote fetch) before it waits for the prefill."""
        return self.swap_s + (self.remote_s if self.remote_fetch else 0.0)

    @property
    def ttft_s(self) -> float:
        return self.fixed_s + self.queue_s + self.swap_s + self.remote_s + self.prefill_s

    @property
    def others_wait_s(self) -> float:
        """The wait it adds to known requests it goes before: its own tokens' time for each less
        urgent one it overtakes (they share its steps), and the rest of its prefill for each
        still loading its KV that joins meanwhile."""
        return self.overtakes * self.own_s + self.cuts_in_s


@lru_cache(maxsize=256)  # a pool's costs are few and constant: one seed each, not one per call
def seeded(costs: PoolCosts) -> CostTerms:
    """CostTerms.seed(costs), kept."""
    return CostTerms.seed(costs)


def estimate(
    overlap: Overlap,
    load: Load,
    costs: PoolCosts,
    terms: CostTerms | None = None,
    priority: int | None = None,
) -> Estimate:
    """Estimated TTFT terms on one replica; `terms` default to the seed of `costs`. `priority`:
    the engine priority the request is sent with, when the replica schedules by it (None: first
    come, first served)."""
    t = terms if terms is not None else seeded(costs)
    per_token = t.prefill_s_per_token
    uncached = overlap.uncached_tokens
    cpu_tokens, remote_tokens = overlap.cpu_tokens, overlap.remote_tokens
    swap_tokens = cpu_tokens * (1 + load.swaps_in_flight)
    swap_s = swap_tokens * t.swap_s_per_token

    remote_s = 0.0
    remote_fetch = False
    if remote_tokens:
        fetch_s = costs.remote_fixed_s + remote_tokens * t.fetch_s_per_token
        recompute_s = remote_tokens * per_token
        remote_fetch = fetch_s < recompute_s
        remote_s = fetch_s if remote_fetch else recompute_s

    load_s = swap_s + remote_s if remote_fetch else swap_s  # a recompute is prefill work
    own = schedule(load, load_s, costs.engine, t, uncached, priority)
    queue_s, prefill_s, queue_steps, prefill_steps, co_tokens, overtakes = own
    step_wait_s = 0.0
    if queue_s <= 0.0 and load.pending_prefill_tokens <= 0:
        step_wait_s = decode_step_rest_s(load, load_s)
        queue_s = step_wait_s
    cuts_in_s = _cuts_in(load, load_s + queue_s, prefill_s) if load.queue else 0.0
    # positional: Estimate(fixed, queue, swap, remote, prefill, remote_fetch, queue_tokens,
    # swap_tokens, overtakes, cuts_in_s, own_s, steps, prefill_steps, step_wait_s), built once
    # per candidate per request
    return Estimate(
        t.fixed_s,
        queue_s,
        swap_s,
        remote_s,
        prefill_s,
        remote_fetch,
        co_tokens,
        swap_tokens,
        overtakes,
        cuts_in_s,
        uncached * per_token,
        queue_steps + prefill_steps,
        prefill_steps,
        step_wait_s,
    )


def _cuts_in(load: Load, starts_in_s: float, prefill_s: float) -> float:
    """The wait a prefill from `starts_in_s` to its end adds to the known requests that join the
    queue while it runs: each was still loading its KV (swap-in, remote fetch) when this one
    took the free prefill, and waits for its end (a prefill under way is not interrupted)."""
    ends_in_s = starts_in_s + prefill_s
    return sum(
        ends_in_s - q.joins_in_s for q in load.queue if starts_in_s < q.joins_in_s < ends_in_s
    )
