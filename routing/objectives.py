"""Per-request TTFT objectives: where a request meets its objective with the least harm to
others, and when a sheddable request is shed instead. Pure.

A request's objective is the one it states (the `x-slo-ttft-ms` header, the name the Gateway
API Inference Extension reads for its latency objective: kubernetes-sigs/
gateway-api-inference-extension, pkg/epp/framework/plugins/flowcontrol/ordering/slo_deadline.go)
or its class's default (`classes.<class>.ttft_slo_ms`); none is none.

Placement (`meet`): among the candidates the policy ranked, those whose estimated TTFT is within
the objective; of those, the least wait added to the requests the placement goes before
(routing/cost.py Estimate.others_wait_s: the less urgent ones it overtakes on an engine that
schedules by priority, the ones still loading their KV that join its queue while it prefills);
of equal harm, the policy's order. When none meets the objective the policy's choice stands: a
request that cannot be served in time is served as fast as the fleet can.

Shedding (`shed_retry_after_s`): a request of a sheddable class (batch) that no candidate serves
within its objective is shed. So is one that some candidate serves in time only by delaying a
request already on its way there: the pipeline cannot see those requests' own objectives, and
every one of them is at least as urgent (batch is the least urgent class), so such a placement
counts as pushing a more urgent request past its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from routing.decide import Decision, Score
from routing.types import TenantClass

SHEDDABLE = frozenset({TenantClass.BATCH})


def objective_s(
    requested_ms: float | None, tenant_class: TenantClass, class_ms: Mapping[TenantClass, float]
) -> float | None:
    """The request's TTFT objective in seconds: its own, else its class's; None: none."""
    ms = requested_ms if requested_ms is not None else class_ms.get(tenant_class)
    return None if ms is None else ms / 1000


def _meets(score: Score, objective: float, *, harmless: bool) -> bool:
    e = score.estimate
    return e.ttft_s <= objective and (not harmless or e.others_wait_s == 0)


def meet(decision: Decision, objective: float, tenant_class: TenantClass) -> tuple[Decision, bool]:
    """The decision moved to the first candidate, in the policy's ranking, that meets the
    objective with the least harm to others; and whether it meets it at all. A sheddable
    class meets it only where it harms nobody."""
    harmless = tenant_class in SHEDDABLE
    by_name = {s.replica: s for s in decision.scores}
    meeting = [
        name for name in decision.ranking if _meets(by_name[name], objective, harmless=harmless)
    ]
    if not meeting:
        return decision, False
    least = min(by_name[name].estimate.others_wait_s for name in meeting)
    chosen = next(n for n in meeting if by_name[n].estimate.others_wait_s == least)
    if chosen == decision.replica:
        return decision, True
    ranking = (chosen, *(n for n in decision.ranking if n != chosen))
    return replace(decision, replica=chosen, ranking=ranking), True


def shed_retry_after_s(decision: Decision, tenant_class: TenantClass, meets: bool) -> int | None:
    """For a sheddable request that misses its objective: the Retry-After in seconds, the time
    the shortest prefill queue among its candidates needs to drain (at least 1 s); else None."""
    if meets or tenant_class not in SHEDDABLE:
        return None
    shortest_s = min(s.estimate.queue_s for s in decision.scores)
    return max(1, math.ceil(shortest_s))
