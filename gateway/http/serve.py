"""The OpenAI endpoints' request path: authenticate, admit, read and check the body, plan, hold
or dispatch, forward; and the request's metrics and rate-limit headers, whatever its end.
POST /v1/chat/completions and /v1/completions are served from the app's ASGI entry
(gateway/http/app.py `_App`); /v1/embeddings and /v1/responses through `api_router`."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from gateway.config import GatewayConfig
from gateway.fleet import replica_auth
from gateway.http.body import OFFLOAD_BYTES, BodyError, parse_body_async
from gateway.http.body_fields import check_fields
from gateway.http.disconnect import ClientGone, while_client_waits
from gateway.http.errors import ApiError, bad_request
from gateway.http.exposure import hide_decision
from gateway.http.request_schema import check_request
from gateway.serving.handling import Dispatch, authenticate, dispatch_now, hold
from gateway.serving.lease import Lease
from gateway.serving.plan import Plan
from gateway.serving.relay_response import RelayResponse
from gateway.state import Gateway
from gateway.telemetry import logs, tracing
from gateway.telemetry.metrics import model_label
from gateway.tenancy.rate_limits import Budget
from gateway.tenancy.tenants import Tenant

log = logging.getLogger("cachelane.app")

api_router = APIRouter()


async def chat_completions(request: Request) -> Response:
    return await serve(request, "chat")


async def completions(request: Request) -> Response:
    return await serve(request, "completions")


@api_router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    return await serve(request, "embeddings")


@api_router.post("/v1/responses")
async def responses(request: Request) -> Response:
    return await serve(request, "responses")


async def checked(endpoint: str, body: dict[str, Any], size_bytes: int) -> None:
    """One schema for chat, completions and responses (gateway/http/request_schema.py); a body
    as large as those parsed off the event loop is checked there too (up to MAX_PROMPT_PARTS
    parts, each checked in Python: ~0.1 s for the largest)."""
    if size_bytes <= OFFLOAD_BYTES:
        check_request(endpoint, body)
        return
    await anyio.to_thread.run_sync(check_request, endpoint, body)


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:  # it left while sending its body: not the gateway's error
        raise ApiError(
            499, "the client closed the request while sending its body", code="client_closed"
        ) from None
    raw = b"".join(chunks)
    request.state.raw_body = raw
    config: GatewayConfig = request.app.state.gw.config
    try:
        return await parse_body_async(
            raw, max_depth=config.max_json_depth, max_number_chars=config.max_number_chars
        )
    except BodyError as err:
        raise bad_request(str(err), code=err.code) from None


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413, f"the request body is larger than {max_bytes} bytes", code="request_too_large"
    )


async def serve(request: Request, endpoint: str) -> Response:
    gw: Gateway = request.app.state.gw
    started = time.perf_counter()
    status = 500
    tenant = None
    model: object = None
    relay: RelayResponse | None = None
    reserved: Lease | None = None
    budgets: list[Budget | None] = []  # the tenant's rate limits, as its admission left them
    try:
        tenant = authenticate(gw, request)
        logs.note_tenant(tenant)
        replica_auth.remember_client_headers(request.headers)  # pools[].forward_headers
        budgets.append(await gw.limits.admit_request(tenant))
        body = await read_json(request, gw.config.max_body_bytes)
        check_fields(body, gw.denied_fields[tenant.tenant_class])
        await checked(endpoint, body, len(request.state.raw_body))
        model = body.get("model")
        if endpoint == "responses":  # previous_response_id: only its replica holds it
            await gw.responses.pin(body, tenant)
        plan = await gw.planner.plan(
            endpoint, body, tenant, received_s=started, headers=request.headers
        )
        budgets.append(await gw.limits.admit_tokens(tenant, plan.prompt_tokens))
        dispatched = dispatch_now(gw, plan)  # decided and reserved in one step when not held
        plan, reserved = dispatched if dispatched is not None else await _hold(gw, request, plan)
        logs.note_plan(plan)
        tracing.note_plan(plan)
        # counted, and the prewarmer asked, while the request is on its way to the replica
        asyncio.get_running_loop().call_soon(_after_decision, gw, plan)
        response = await gw.proxy.forward(
            endpoint,
            request.state.raw_body,
            plan,
            client_gone=request.is_disconnected,
            reserved=reserved,
        )
        if endpoint == "responses":
            gw.responses.learn(response, tenant)
        hide_decision(response.headers, request, gw)  # exposure.decision_headers, ...
        response.headers.update(_rate_limit_headers(budgets))
        status = response.status_code
        relay = response if isinstance(response, RelayResponse) else None
        if status >= 400:  # the replica's own error, passed through: an error too, by its status
            gw.metrics.errors.labels(f"replica_{status}").inc()
        return response
    except ApiError as err:
        status = err.status
        err.headers = _rate_limit_headers(budgets) | err.headers  # a refusal's own win
        raise
    finally:
        if reserved is not None:
            reserved.release()  # an error, or a client gone, before the proxy took it over
        label = model_label(model, gw.registry.known_models())
        if relay is None:
            _count(gw, endpoint, label, tenant, started, status)
        else:  # a stream ends when its last byte is sent, after this returns, maybe broken
            relay.on_finish(
                lambda: _count(gw, endpoint, label, tenant, started, relay.final_status)
            )


def _count(
    gw: Gateway, endpoint: str, label: str, tenant: Tenant | None, started: float, status: int
) -> None:
    """A request's counts, once its answer has ended: the requests by final status (a stream
    that broke after its 200 head counts with its error's status, as its access line says), its
    end-to-end time, the tenant's requests."""
    m = gw.metrics
    m.requests.labels(endpoint, label, str(status)).inc()
    m.e2e_seconds.labels(endpoint, label).observe(time.perf_counter() - started)
    if tenant is not None:
        m.tenant_requests.labels(tenant.name, tenant.tenant_class.value, str(status)).inc()


async def _hold(gw: Gateway, request: Request, plan: Plan) -> Dispatch:
    """Flow control's wait, given up as soon as the client disconnects (a held request would
    otherwise keep its place and be sent)."""
    try:
        return await while_client_waits(
            hold(gw, plan), request.is_disconnected, abandoned=_release_abandoned
        )
    except ClientGone:
        raise ApiError(
            499, "the client closed the request while it was held", code="client_closed"
        ) from None


async def _release_abandoned(dispatched: Dispatch) -> None:
    """A request dispatched as its client left: nothing will send it."""
    _, reserved = dispatched
    if reserved is not None:
        reserved.release()


def _rate_limit_headers(budgets: list[Budget | None]) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for each budget the request was admitted by."""
    headers: dict[str, str] = {}
    for budget in budgets:
        if budget is not None:
            headers.update(budget.headers())
    return headers


def _after_decision(gw: Gateway, plan: Plan) -> None:
    _count_decision(gw, plan)
    gw.prewarmer.consider(plan)


def _count_decision(gw: Gateway, plan: Plan) -> None:
    d = plan.decision
    gw.metrics.decisions.labels(d.policy.value, d.reason.value, d.replica).inc()
    gw.metrics.decision_seconds.observe(plan.decision_s)
    gw.metrics.expected_cached_tokens.inc(d.expected_cached_tokens)
    gw.metrics.estimated_prompt_tokens.inc(plan.prompt_tokens)
    log.debug(
        "route %s -> %s (%s) est %.1f ms cached %d",
        plan.model,
        d.replica,
        d.reason.value,
        d.est_ttft_s * 1000,
        d.expected_cached_tokens,
    )
