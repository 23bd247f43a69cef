"""A request's way through the gateway's state, before the proxy: who sends it (authenticate),
and when it may go (dispatch at once, or hold it in flow control's queue)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request

from gateway.http.errors import ApiError, retry_later
from gateway.serving.flow import FlowControl, Shed
from gateway.serving.lease import Lease
from gateway.serving.planner import Plan
from gateway.state import Gateway
from gateway.telemetry.tracing import note_queue_wait
from gateway.tenancy.tenants import CLASS_HEADER, Tenant
from routing.types import TenantClass

# A request ready to send: its plan and the lease on its first choice, reserved in the step that
# decided it (None: no healthy replica); whoever holds the lease releases it
# (gateway/serving/lease.py).
Dispatch = tuple[Plan, Lease | None]


def authenticate(gw: Gateway, request: Request) -> Tenant:
    """The request's tenant, served at the class it asks for (lower only)."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    tenant = gw.tenants.authenticate(key.strip() if scheme.lower() == "bearer" else None)
    if tenant is None:
        raise ApiError(
            401,
            "invalid or missing API key; send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
    return served_at_asked_class(tenant, request)


def served_at_asked_class(tenant: Tenant, request: Request) -> Tenant:
    """The tenant served at the class the request asks for (x-cachelane-class: lower only)."""
    asked = request.headers.get(CLASS_HEADER)
    if asked is None:
        return tenant
    try:
        lowered = tenant.lowered_to(TenantClass(asked))
    except ValueError:
        lowered = None
    if lowered is None:
        raise ApiError(
            403,
            f"{CLASS_HEADER}: {asked!r} is not a class this tenant may use; a request may "
            f"ask for a lower class than {tenant.tenant_class.value!r}, never a higher one",
            code="class_not_allowed",
        )
    return lowered


def dispatch(gw: Gateway, plan: Plan) -> Dispatch:
    """The plan and its first choice, reserved in this very step (Proxy.reserve_first)."""
    return plan, gw.proxy.reserve_first(plan)


def dispatch_now(gw: Gateway, plan: Plan) -> Dispatch | None:
    """Dispatch without an await between the decision and its reservation when flow control
    lets the request go at once (its class has no budget, or it fits the budget with no one
    of its class or above waiting); None when it must wait (hold)."""
    held = _flow_for(gw, plan)
    klass = plan.tenant.tenant_class
    if held is not None and not held[0].admit_now(klass, held[1]):
        return None
    if gw.flow is not None:
        gw.metrics.flow_wait_seconds.labels(klass.value).observe(0.0)
    note_queue_wait(0.0)
    return dispatch(gw, plan)


async def hold(gw: Gateway, plan: Plan) -> Dispatch:
    """Flow control: wait, in the class's queue, until the request fits its class's TTFT
    budget somewhere (critical first, then standard, then batch; round robin between
    tenants); then decide again on the load of now and dispatch in the same step. Raises 503
    with Retry-After when the queue is full or the wait passed the class's maximum."""
    held = _flow_for(gw, plan)
    if held is None:
        return dispatch(gw, plan)
    flow, ready = held
    klass = plan.tenant.tenant_class
    try:
        waited_s = await flow.admit(plan.tenant.name, klass, ready)
    except Shed as err:
        gw.metrics.flow_shed.labels(klass.value, err.reason).inc()
        raise retry_later(
            503,
            f"the fleet is saturated and this {klass.value} request "
            + (
                "found its class's queue full"
                if err.reason == "queue_full"
                else "waited its class's maximum"
            )
            + "; retry later",
            code="overloaded",
            retry_after_s=err.retry_after_s,
        ) from None
    gw.metrics.flow_wait_seconds.labels(klass.value).observe(waited_s)
    note_queue_wait(waited_s)
    try:
        return dispatch(gw, gw.planner.replan(plan))
    except BaseException:
        flow.kick()  # it will not reserve: let the next one go
        raise


def _flow_for(gw: Gateway, plan: Plan) -> tuple[FlowControl, Callable[[], bool]] | None:
    """Flow control and the request's ready() predicate, or None when it is not held now (no
    TTFT budget for its class, flow control off, or no more urgent class active to hold it
    for and none of its own waiting: FlowControl.holds)."""
    klass = plan.tenant.tenant_class
    budget_ms = getattr(gw.config.classes, klass.value).ttft_budget_ms
    if gw.flow is None:
        return None
    gw.flow.arrived(klass)
    if budget_ms is None or not gw.flow.holds(klass):
        return None
    flow, budget_s, planner = gw.flow, budget_ms / 1000, gw.planner

    def ready() -> bool:
        return not flow.higher_class_waiting(klass) and planner.within_budget(plan, budget_s)

    return flow, ready
