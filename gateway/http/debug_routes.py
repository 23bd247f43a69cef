"""POST /debug/route: how a prompt would be routed and how much of it is cached, without running
it, as the admin sees it (or as the tenant named in x-cachelane-tenant)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gateway.http.errors import ApiError
from gateway.http.request_schema import check_request
from gateway.http.serve import read_json
from gateway.serving.handling import authenticate, served_at_asked_class
from gateway.serving.plan import Plan
from gateway.state import Gateway
from gateway.tenancy.admin_auth import require_admin
from gateway.tenancy.tenants import ANONYMOUS, Tenant

debug_router = APIRouter()


@debug_router.post("/debug/route")
async def debug_route(request: Request) -> dict[str, Any]:
    """How many of a prompt's tokens are cached, without running it: the admin key's view
    (a tenant's key would make it a prompt-guessing oracle); `x-cachelane-tenant: NAME`
    explains it as that tenant. In auth.mode open, as the anonymous tenant."""
    gw: Gateway = request.app.state.gw
    tenant = debug_tenant(gw, request)
    body = await read_json(request, gw.config.max_body_bytes)
    endpoint = "chat" if "messages" in body else "completions"
    endpoint = "responses" if "input" in body and "prompt" not in body else endpoint
    check_request(endpoint, body)  # the body as the endpoint itself would check it
    plan = await gw.planner.plan(endpoint, body, tenant, dry_run=True, headers=request.headers)
    return explain(plan) | {"load": gw.loads(), "costs": gw.learner.describe()}


DEBUG_TENANT_HEADER = "x-cachelane-tenant"


def debug_tenant(gw: Gateway, request: Request) -> Tenant:
    """/debug/route's tenant: the admin key is required unless auth is open; the tenant named
    in DEBUG_TENANT_HEADER (404 if there is none of that name), else the anonymous one."""
    if gw.tenants.open_mode:
        return authenticate(gw, request)
    require_admin(request)
    name = request.headers.get(DEBUG_TENANT_HEADER)
    if name is None:
        tenant = ANONYMOUS
    else:
        found = next((t for t in gw.tenants.list() if t.name == name), None)
        if found is None:
            raise ApiError(404, f"{DEBUG_TENANT_HEADER}: no tenant {name!r}", code="not_found")
        tenant = found
    return served_at_asked_class(tenant, request)


def explain(plan: Plan) -> dict[str, Any]:
    d = plan.decision
    admission = plan.admission

    def ms(seconds: float) -> float:
        return round(seconds * 1000, 3)

    return {
        "policy": d.policy.value,
        "replica": d.replica,
        "reason": d.reason.value,
        "ranking": list(d.ranking),
        "tenant": plan.tenant.name,
        "tenant_class": plan.tenant.tenant_class.value,
        "fallback": plan.fallback.value if plan.fallback else None,
        "prompt_tokens": plan.prompt_tokens,
        "blocks": len(plan.hashes),
        "est_ttft_ms": ms(d.est_ttft_s),
        "expected_cached_tokens": d.expected_cached_tokens,
        "remote_write": None
        if admission is None
        else {
            "write": admission.write,
            "expected_reuse": admission.expected_reuse,
            "gain_ms": ms(admission.gain_s),
            "cost_ms": ms(admission.cost_s),
        },
        "decision_ms": ms(plan.decision_s),
        "candidates": [
            {
                "replica": s.replica,
                "overlap": s.overlap._asdict(),
                "estimate_ms": {
                    "fixed_s": ms(s.estimate.fixed_s),
                    "queue_s": ms(s.estimate.queue_s),
                    "swap_s": ms(s.estimate.swap_s),
                    "remote_s": ms(s.estimate.remote_s),
                    "prefill_s": ms(s.estimate.prefill_s),
                    "ttft": ms(s.estimate.ttft_s),
                },
                # the wait it would add to known requests it goes before (what cache_aware adds
                # to the TTFT to rank the candidates: routing/policies/cache_aware.py)
                "others_wait_ms": ms(s.estimate.others_wait_s),
                "queue_tokens": round(s.estimate.queue_tokens),
                # engine steps until its first token, and its own (routing/prefill_steps.py)
                "steps": round(s.estimate.steps, 2),
                "prefill_steps": s.estimate.prefill_steps,
                "remote_fetch": s.estimate.remote_fetch,
                "expected_cached_tokens": s.expected_cached_tokens,
            }
            for s in d.scores
        ],
    }
