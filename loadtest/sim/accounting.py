"""What a simulated prefill reports, and the replica's counters (engine.py fills both)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefillResult:
    prompt_tokens: int
    hbm_tokens: int  # reused from this replica's HBM
    cpu_tokens: int  # swapped in from the CPU tier
    remote_tokens: int  # fetched from the remote tier (recomputed ones are not counted here)
    computed_tokens: int  # prefilled: the uncached tail plus any remote tokens recomputed
    queue_wait_s: float = 0.0  # wall time from its KV being loaded to holding the prefill slot
    swap_sharers: int = 0  # swap-ins on the PCIe link during its own (itself included), 0: none
    # wall time from arriving at prefill() to: its tiers looked up (the remote tier's lookup is
    # an HTTP call), its KV loaded, its first chunk scheduled, its first token
    phases_s: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    # time.monotonic() as it arrived at prefill(), the step engine only: one clock for every
    # replica on the machine, so a benchmark can replay a replica's arrivals in order
    arrived_at_s: float = 0.0

    @property
    def cached_tokens(self) -> int:
        return min(self.prompt_tokens, self.hbm_tokens + self.cpu_tokens + self.remote_tokens)


@dataclass(slots=True)
class EngineStats:
    """Monotonic counters since start (exported as Prometheus counters by server.py)."""

    prefix_cache_queries_tokens: int = 0  # prompt tokens looked up (vLLM: prefix_cache_queries)
    prefix_cache_hits_tokens: int = 0  # of those, found in HBM (vLLM: prefix_cache_hits)
    external_queries_tokens: int = 0  # tokens looked up beyond HBM, in the CPU / remote tiers
    external_hits_tokens: int = 0  # of those, reused (vLLM: external_prefix_cache_hits)
    swap_in_tokens: int = 0
    swap_ins: int = 0  # requests that swapped in from the CPU tier
    swap_link_sharers: int = 0  # sum over them of the swap-ins on the link (itself included)
    hbm_evicted_blocks: int = 0  # blocks pushed out of HBM (demoted to the CPU tier or dropped)
    remote_fetch_tokens: int = 0
    remote_recompute_tokens: int = 0  # found in the remote tier but cheaper to recompute
    remote_bytes_written: int = 0
    remote_bytes_skipped: int = 0  # a write was declined (x-cachelane-remote-write: 0)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # Wall time from joining the prefill queue to holding the slot (modelled time * time_factor)
    queue_wait_s_sum: float = 0.0
    queue_wait_count: int = 0
