"""What a replay comes to, per tenant class, and how many replicas a TTFT target needs. Pure.

Per class (and "all"): TTFT p50 / p99, the prompt tokens served from each tier (hit rate by tier),
the bytes that crossed PCIe (CPU-tier swap-ins) and the network (remote fetches and writes). Fleet
wide: remote-tier bytes written and never read (evicted unread, or still unread at the end), HBM
evictions. `replicas_needed` searches the replica count of the pool that served a class.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from routing.whatif.capture import CapturedRequest
from routing.whatif.replay import Outcome, Replayed, replay
from routing.whatif.setup import Setup

ALL = "all"

MAX_REPLICAS = 64  # the search's upper bound per pool: a plan beyond it is a different fleet


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class ClassSummary:
    requests: int
    rejected: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    hit_rate: float  # cached / prompt tokens
    hbm_hit_rate: float
    cpu_hit_rate: float
    remote_hit_rate: float
    pcie_bytes: int
    network_read_bytes: int
    network_written_bytes: int
    queue_p99_ms: float


@dataclass(frozen=True, slots=True)
class Summary:
    scenario: str
    classes: dict[str, ClassSummary]
    remote_written_bytes: int
    remote_never_read_bytes: int  # evicted unread + still unread at the end
    hbm_evicted_blocks: int
    replicas: dict[str, int]  # pool -> replicas in the set-up

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _class_summary(rows: Sequence[Replayed], rejected: int) -> ClassSummary:
    prompt = sum(r.prompt_tokens for r in rows) or 1
    ttfts = [r.ttft_s * 1000 for r in rows]
    return ClassSummary(
        requests=len(rows),
        rejected=rejected,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        hit_rate=sum(r.hbm_tokens + r.cpu_tokens + r.remote_tokens for r in rows) / prompt,
        hbm_hit_rate=sum(r.hbm_tokens for r in rows) / prompt,
        cpu_hit_rate=sum(r.cpu_tokens for r in rows) / prompt,
        remote_hit_rate=sum(r.remote_tokens for r in rows) / prompt,
        pcie_bytes=sum(r.pcie_bytes for r in rows),
        network_read_bytes=sum(r.fetched_bytes for r in rows),
        network_written_bytes=sum(r.written_bytes for r in rows),
        queue_p99_ms=percentile([r.queue_s * 1000 for r in rows], 99),
    )


def summarize(outcome: Outcome) -> Summary:
    by_class: dict[str, list[Replayed]] = {}
    for r in outcome.requests:
        by_class.setdefault(r.tenant_class, []).append(r)
    classes = {
        k: _class_summary(rows, outcome.rejected.get(k, 0)) for k, rows in sorted(by_class.items())
    }
    classes[ALL] = _class_summary(outcome.requests, sum(outcome.rejected.values()))
    block_bytes = {
        p.remote_tier: outcome.setup.block_size_tokens * p.costs.kv_bytes_per_token
        for p in outcome.setup.pools
        if p.remote_tier
    }
    bytes_per_block = max(block_bytes.values(), default=0)
    unread = outcome.remote_resident_unread_blocks + sum(
        s.evicted_unread_blocks for s in outcome.remote.values()
    )
    return Summary(
        scenario=outcome.setup.name,
        classes=classes,
        remote_written_bytes=sum(s.written_blocks for s in outcome.remote.values())
        * bytes_per_block,
        remote_never_read_bytes=unread * bytes_per_block,
        hbm_evicted_blocks=outcome.hbm_evicted_blocks,
        replicas={p.name: p.replicas for p in outcome.setup.pools},
    )


@dataclass(frozen=True, slots=True)
class Needed:
    pool: str
    replicas: int | None  # None: not met within MAX_REPLICAS
    ttft_ms: float  # the class's TTFT at that count (at MAX_REPLICAS when not met)


def serving_pool(outcome: Outcome, tenant_class: str) -> str | None:
    """The pool that served most of the class's requests."""
    counts: dict[str, int] = {}
    for r in outcome.requests:
        if tenant_class in (ALL, r.tenant_class):
            counts[r.pool] = counts.get(r.pool, 0) + 1
    return max(sorted(counts), key=lambda p: counts[p]) if counts else None


def replicas_needed(
    requests: Sequence[CapturedRequest],
    setup: Setup,
    tenant_class: str,
    target_ms: float,
    *,
    quantile: float = 99.0,
    seed: int = 0,
    max_replicas: int = MAX_REPLICAS,
    cache: dict[tuple[str, int], Outcome] | None = None,
) -> Needed | None:
    """The fewest replicas of the pool serving `tenant_class` at which the class's TTFT at
    `quantile` meets `target_ms`, by bisection (TTFT is taken to fall as replicas are added;
    the other pools stay as they are). None when the class has no requests."""
    memo = cache if cache is not None else {}

    def at(pool: str, n: int) -> Outcome:
        key = (pool, n)
        if key not in memo:
            memo[key] = replay(requests, setup.with_replicas(pool, n), seed=seed)
        return memo[key]

    current = {p.name: p.replicas for p in setup.pools}
    base_pool = serving_pool(replay(requests, setup, seed=seed), tenant_class)
    if base_pool is None:
        return None

    def ttft_ms(n: int) -> float:
        rows = [
            r.ttft_s * 1000
            for r in at(base_pool, n).requests
            if tenant_class in (ALL, r.tenant_class)
        ]
        return percentile(rows, quantile)

    ok: Callable[[int], bool] = lambda n: ttft_ms(n) <= target_ms  # noqa: E731
    hi = current[base_pool]
    while not ok(hi):
        if hi >= max_replicas:
            return Needed(base_pool, None, ttft_ms(hi))
        hi = min(max_replicas, hi * 2)
    lo = 0  # 0 replicas never meet a target
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return Needed(base_pool, hi, ttft_ms(hi))
