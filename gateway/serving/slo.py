"""Attainment of per-request TTFT objectives (routing/objectives.py): the counter
cachelane_slo_attained_total{class,tenant,outcome}.

A request with an objective (its `x-slo-ttft-ms`, or its class's `ttft_slo_ms`) counts once:
`shed` when the pipeline shed it (gateway/serving/planner.py), else `met` or `missed` by the TTFT
the client saw at the first byte of a streamed answer: from the moment the request reached the
gateway (body read, decision, flow control included) to the replica's first byte. A whole
(non-streamed) answer's first byte comes after its whole generation, so it is not judged; nor
is a request that ended before any byte.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from gateway.telemetry.metrics import Metrics
from gateway.tenancy.tenants import Tenant

if TYPE_CHECKING:
    from gateway.serving.plan import Plan

Outcome = Literal["met", "missed", "shed"]


def count(metrics: Metrics, tenant: Tenant, outcome: Outcome) -> None:
    metrics.slo_attained.labels(tenant.tenant_class.value, tenant.name, outcome).inc()


def observe_first_byte(metrics: Metrics, plan: Plan, sent_s: float, ttft_s: float) -> None:
    """At a request's first byte: `sent_s`, when it was sent (perf_counter, the reservation's
    start); `ttft_s`, the time from then to the first byte. Counts nothing for a request without
    an objective or a whole answer."""
    objective_ms = plan.ttft_objective_ms
    if objective_ms is None or not plan.stream:
        return
    seen_ms = 1000 * (plan.in_gateway_s(sent_s) + ttft_s)
    count(metrics, plan.tenant, "met" if seen_ms <= objective_ms else "missed")
