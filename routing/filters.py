"""Which replicas a request may use, by tenant class. Runs before decide(); pure.

critical  the pinned pools first (HBM-only, provisioned up front), and only replicas under their
          admission cap, so their latency stays predictable. The shared pools are the critical
          request's `overflow`: routing/pipeline.py spills there, with the full cost model, when
          even the best pinned replica's estimate is over the class's TTFT budget. With no pinned
          replica admitted, the configured fallback applies: `spill` to the shared pools, or
          `reject` (the gateway answers 503 with Retry-After). With no pinned pool at all,
          critical requests use the shared pools. HBM-only is a property of a pool, not of a
          tenant: wherever a critical request goes, CPU and remote hits count as they would for
          anyone.
          With `cost_placement` (config `critical.placement: cost`, the default with `spill`)
          the pinned pool is a preference, not a wall (routing/pipeline.py CLOSE_COST):
          every pinned replica, whatever its queue, and every shared one are candidates, and
          the cost model picks the lowest estimated TTFT. A follow-up then
          goes where its context is, in whichever pool (the pinned pool is HBM-only: a context
          built there is found nowhere else), and the admission cap is judged by the estimate,
          which holds the queue, instead of by a fixed token count.
standard  the shared pools; a pinned replica too while its pool lends (the replica is below
batch     `lend_below` of its admission cap, 1.0 by default, and no cap means always) and the
          caller says lending is on (under pinned_first, off for a while after a critical
          request found no pinned replica free: routing/pipeline.py Routed.reclaim_s).
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
    fallback: Fallback | None = None  # set when a critical request left the pinned pool
    overflow: tuple[Candidate, ...] = ()  # critical: shared replicas to spill to when over budget


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
    lend: bool = True,
    cost_placement: bool = False,
) -> Eligibility:
    """`candidates` are the healthy replicas serving the model; `pinned_pool_exists` says whether
    the config has a pinned pool for it at all (down is not the same as absent)."""
    pinned = [c for c in candidates if c.pool.pinned]
    shared = [c for c in candidates if not c.pool.pinned]
    if tenant_class is TenantClass.CRITICAL:
        if not pinned_pool_exists:
            return Eligibility(tuple(shared))
        if cost_placement and pinned and fallback is Fallback.SPILL:
            return Eligibility(tuple(pinned + shared))
        open_pinned = [c for c in pinned if admitted(c)]
        if open_pinned:
            return Eligibility(tuple(open_pinned), overflow=tuple(shared))
        if fallback is Fallback.SPILL:
            return Eligibility(tuple(shared), fallback=Fallback.SPILL)
        return Eligibility((), fallback=Fallback.REJECT)
    lent = [
        c
        for c in pinned
        if lend and c.pool.lend_below is not None and admitted(c, c.pool.lend_below)
    ]
    return Eligibility(tuple(shared + lent))


def should_shed(decision: Decision, tenant_class: TenantClass, max_queue_s: float) -> bool:
    """Batch traffic is shed first: when even its best replica has more than `max_queue_s` of
    prefill queued ahead of it."""
    if tenant_class is not TenantClass.BATCH:
        return False
    return decision.score().estimate.queue_s > max_queue_s
