"""Which replicas a request may use, by tenant class. Runs before decide(); pure.

critical  only pinned pools (HBM-only, provisioned up front), and only replicas under their
          admission cap, so their latency stays predictable. With no pinned replica admitted,
          the configured fallback applies: `spill` to the shared pools counting HBM hits only,
          or `reject` (the gateway answers 503 with Retry-After). With no pinned pool at all,
          critical requests use the shared pools, HBM hits only.
standard  the shared pools; a pinned replica only if its pool lends idle capacity and the
batch     replica is below `lend_below` of its admission cap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from routing.decide import Candidate, Decision
from routing.types import TenantClass


class Fallback(StrEnum):
    SPILL = "spill"
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class Eligibility:
    candidates: tuple[Candidate, ...]
    hbm_only: bool  # count HBM hits only (critical tenants)
    fallback: Fallback | None = None  # set when a critical request left the pinned pool


def admitted(c: Candidate, fraction: float = 1.0) -> bool:
    """Is the replica below `fraction` of its pool's admission cap?"""
    rules = c.pool
    if rules.max_in_flight is not None and c.load.in_flight >= fraction * rules.max_in_flight:
        return False
    return not (
        rules.max_prefill_tokens is not None
        and c.load.pending_prefill_tokens >= fraction * rules.max_prefill_tokens
    )


def eligible(
    candidates: Sequence[Candidate],
    tenant_class: TenantClass,
    fallback: Fallback,
    *,
    pinned_pool_exists: bool,
) -> Eligibility:
    """`candidates` are the healthy replicas serving the model; `pinned_pool_exists` says whether
    the config has a pinned pool for it at all (down is not the same as absent)."""
    pinned = [c for c in candidates if c.pool.pinned]
    shared = [c for c in candidates if not c.pool.pinned]
    if tenant_class is TenantClass.CRITICAL:
        if not pinned_pool_exists:
            return Eligibility(tuple(shared), hbm_only=True)
        open_pinned = [c for c in pinned if admitted(c)]
        if open_pinned:
            return Eligibility(tuple(open_pinned), hbm_only=True)
        if fallback is Fallback.SPILL:
            return Eligibility(tuple(shared), hbm_only=True, fallback=Fallback.SPILL)
        return Eligibility((), hbm_only=True, fallback=Fallback.REJECT)
    lent = [c for c in pinned if c.pool.lend_below is not None and admitted(c, c.pool.lend_below)]
    return Eligibility(tuple(shared + lent), hbm_only=False)


def should_shed(decision: Decision, tenant_class: TenantClass, max_queue_s: float) -> bool:
    """Batch traffic is shed first: when even its best replica has more than `max_queue_s` of
    prefill queued ahead of it."""
    if tenant_class is not TenantClass.BATCH:
        return False
    return decision.score().estimate.queue_s > max_queue_s
