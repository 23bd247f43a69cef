"""The tier cost model: estimated time to first token of a request on one replica.

    est_ttft = t_queue + t_swap + t_remote + t_prefill

    t_queue   = prefill tokens already waiting on the replica / prefill rate
                + running requests * (prefill chunks of this request) * one decode token each
    t_swap    = CPU-tier tokens * KV bytes per token / (PCIe bandwidth / (1 + swap-ins in flight))
    t_remote  = min(remote fixed cost + remote tokens * KV bytes per token / network bandwidth,
                    remote tokens / prefill rate)            # fetch only when it beats recompute
    t_prefill = uncached tokens / prefill rate

Constants are per pool (config); the defaults describe Llama-3.1-8B in BF16 on one H200.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_BYTES_PER_TOKEN = 131_072
# Llama-3.1-8B, BF16: 32 layers * 8 KV heads * 128 head dim * 2 (K and V) * 2 bytes = 128 KiB
# (meta-llama/Llama-3.1-8B config.json: num_hidden_layers=32, num_key_value_heads=8, head_dim=128).

PREFILL_TOKENS_PER_S = 30_000.0
# ~30k prompt tokens/s for an 8B model on one H200 (DESIGN.md's table; vLLM prefill-only throughput
# benchmarks for Llama-3.1-8B on H100/H200 report 25-35k tokens/s).

PCIE_GBPS = 50.0
# Host-to-device copy on PCIe Gen5 x16: ~50 GB/s measured (63 GB/s theoretical), DESIGN.md's table.

REMOTE_GBPS = 24.0
# 400 Gb/s RDMA NIC: 50 GB/s line rate, ~24 GB/s effective for KV transfers (DESIGN.md's table,
# Mooncake / LMCache remote-backend figures).

REMOTE_FIXED_S = 0.026
# ~26 ms fixed cost per remote fetch (lookup + connection + first byte), DESIGN.md's table.

PREFILL_CHUNK_TOKENS = 8_192
# vLLM V1 chunked prefill: max_num_batched_tokens defaults to 8192 for the OpenAI server on GPUs
# with >= 70 GiB (vllm/engine/arg_utils.py, default_max_num_batched_tokens); each chunk shares a
# step with every running decode.

HBM_CAPACITY_TOKENS = 800_000
# Llama-3.1-8B BF16 on one H200: 141 GB HBM (NVIDIA H200 datasheet) * 0.9 (vLLM's default
# gpu_memory_utilization) - 16.1 GB of weights (8.03e9 parameters * 2 bytes) - ~5 GB for the
# profiled activation peak and CUDA graphs (an estimate) = ~105 GB, / 128 KiB per token = ~0.8M.


@dataclass(frozen=True, slots=True)
class PoolCosts:
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN
    prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S
    pcie_gbps: float = PCIE_GBPS
    remote_gbps: float = REMOTE_GBPS
    remote_fixed_s: float = REMOTE_FIXED_S
    prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS


@dataclass(frozen=True, slots=True)
class Load:
    """What a replica is busy with, as the gateway sees it at decision time."""

    in_flight: int = 0  # requests sent and not finished
    pending_prefill_tokens: int = 0  # uncached prompt tokens sent and not yet past first token
    swaps_in_flight: int = 0  # requests still swapping KV in from the CPU tier


@dataclass(frozen=True, slots=True)
class Overlap:
    """How a request's prompt of `prompt_tokens` splits on one replica, in tokens."""

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


@dataclass(frozen=True, slots=True)
class Estimate:
    queue_s: float
    swap_s: float
    remote_s: float
    prefill_s: float
    remote_fetch: bool  # True when fetching from the remote tier beats recomputing those tokens

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.swap_s + self.remote_s + self.prefill_s


def estimate(
    overlap: Overlap, load: Load, costs: PoolCosts, *, correction: float = 1.0
) -> Estimate:
    """Estimated TTFT terms. `correction` (self-calibration: observed / estimated TTFT on this
    replica, 1.0 = none) scales every term, as if the replica's rates were that much slower."""
    rate = costs.prefill_tokens_per_s
    uncached = overlap.uncached_tokens
    chunks = -(-max(uncached, 1) // costs.prefill_chunk_tokens)
    queue_s = (load.pending_prefill_tokens + load.in_flight * chunks) / rate

    swap_bytes_per_s = costs.pcie_gbps * 1e9 / (1 + load.swaps_in_flight)
    swap_s = overlap.cpu_tokens * costs.kv_bytes_per_token / swap_bytes_per_s

    remote_s = 0.0
    remote_fetch = False
    if overlap.remote_tokens:
        fetch_s = costs.remote_fixed_s + overlap.remote_tokens * costs.kv_bytes_per_token / (
            costs.remote_gbps * 1e9
        )
        recompute_s = overlap.remote_tokens / rate
        remote_fetch = fetch_s < recompute_s
        remote_s = min(fetch_s, recompute_s)

    return Estimate(
        queue_s=queue_s * correction,
        swap_s=swap_s * correction,
        remote_s=remote_s * correction,
        prefill_s=uncached / rate * correction,
        remote_fetch=remote_fetch,
    )
