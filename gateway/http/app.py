"""The FastAPI app: OpenAI endpoints in front of the replicas, plus health, readiness, metrics
and /debug/route. Built by `create_app(config)`; the lifespan owns every long-lived resource."""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import __version__
from gateway.accounting.ledger import costs_router
from gateway.components import start_all
from gateway.config import GatewayConfig
from gateway.fleet import replica_auth
from gateway.http.body import BodyError, parse_body_async
from gateway.http.body_fields import check_fields
from gateway.http.disconnect import ClientGone, while_client_waits
from gateway.http.errors import ApiError, bad_request
from gateway.http.exposure import (
    POLICY_STATE_KEY,
    AuthFailures,
    ConnectionPolicy,
    FailedAuthLimit,
    ReadDeadline,
    hide_decision,
    require_monitoring,
)
from gateway.http.openapi import schema_of
from gateway.http.request_schema import check_request
from gateway.http.responses_routes import responses_router
from gateway.serving.handling import (
    Dispatch,
    authenticate,
    dispatch_now,
    hold,
    served_at_asked_class,
)
from gateway.serving.lease import Lease
from gateway.serving.plan import Plan
from gateway.serving.proxy import RelayResponse
from gateway.state import Gateway
from gateway.telemetry import logs, tracing
from gateway.telemetry.metrics import Metrics, model_label
from gateway.tenancy.admin import admin_router
from gateway.tenancy.admin_auth import require_admin
from gateway.tenancy.rate_limits import Budget
from gateway.tenancy.tenants import ANONYMOUS, Tenant
from gateway.wiring import build_gateway

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("cachelane.app")


def create_app(
    config: GatewayConfig,
    *,
    span_exporter: SpanExporter | None = None,
    config_path: str | None = None,
) -> FastAPI:
    """`span_exporter`: where spans go when config.tracing is enabled, instead of OTLP;
    `config_path`: the file `config` came from, reloaded on SIGHUP and POST /admin/reload."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        gw = build_gateway(config, config_path=config_path)
        app.state.gw = gw
        async with contextlib.AsyncExitStack() as stack:
            await start_all(gw.components, stack)  # closed in reverse when the stack unwinds
            policy = ConnectionPolicy(  # read by the HTTP protocol (gateway/http/exposure.py)
                config.listen.header_timeout_s,
                lambda part: gw.metrics.read_timeouts.labels(part).inc(),
            )
            yield {POLICY_STATE_KEY: policy}

    logs.quiet_http_clients()
    docs = config.exposure.docs  # the OpenAPI schema and its pages: off unless enabled
    app = _App(
        title="cachelane",
        version=__version__,
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.openapi = schema_of(app)  # type: ignore[method-assign]
    _install_error_handlers(app)
    app.add_middleware(
        ReadDeadline,
        body_timeout_s=config.listen.body_timeout_s,
        on_timeout=lambda part: app.state.gw.metrics.read_timeouts.labels(part).inc(),
    )
    if config.tracing.enabled:  # inside RequestContext: the span reads its access record
        app.add_middleware(
            tracing.TracingMiddleware, tracer=tracing.tracer_from(config.tracing, span_exporter)
        )
    app.add_middleware(  # inside RequestContext: its 429s are logged
        FailedAuthLimit,
        failures=AuthFailures(config.rate_limits.failed_auth_per_min),
        on_refused=lambda: _count_auth_throttled(app),
    )
    app.add_middleware(logs.RequestContext)  # outside _Unexpected: its 500s are logged too
    app.include_router(admin_router)
    app.include_router(costs_router)  # GET /debug/costs, with the admin key
    app.include_router(responses_router)  # GET, DELETE /v1/responses/{id}, and its cancel

    # The two hot endpoints skip the framework's layers (_App.__call__); these routes give the other
    # methods their 405 and list them in the route table.
    async def chat_completions(request: Request) -> Response:
        return await _serve(request, "chat")

    async def completions(request: Request) -> Response:
        return await _serve(request, "completions")

    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.hot = {"/v1/chat/completions": chat_completions, "/v1/completions": completions}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await _serve(request, "embeddings")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await _serve(request, "responses")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        gw: Gateway = request.app.state.gw
        authenticate(gw, request)
        return {"object": "list", "data": list(gw.registry.model_cards().values())}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> dict[str, Any]:
        gw: Gateway = request.app.state.gw
        authenticate(gw, request)
        card = gw.registry.model_cards().get(model)
        if card is None:
            gw.planner.model_of({"model": model})  # 503 while it may yet be served, else 404
        return card or {}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        gw: Gateway = request.app.state.gw
        if config.exposure.ready_auth:
            require_monitoring(request, gw)
        replicas = {
            r.name: {
                "healthy": r.healthy,
                "pool": r.pool.name,
                "models": sorted(r.models),
                "in_flight": r.in_flight,
                "last_error": r.last_error,
                "ejected": None if r.ejection is None else r.ejection.view(time.monotonic()),
            }
            for r in gw.registry.replicas.values()
        }
        # no key is served before the tenants in Redis were read once (gateway/tenancy/store.py)
        ok = gw.tenants.loaded and any(r.healthy for r in gw.registry.replicas.values())
        body = {
            "ready": ok,
            "index": gw.index_status(),
            "tenants": gw.tenants.status(),
            "replicas": replicas,
        }
        if gw.kv_events is not None:
            body["kv_events"] = gw.kv_events.status()
        if gw.flow is not None:
            body["flow_control"] = gw.flow.stats()
        if any(p.pinned for p in gw.config.pools):  # undersized or not (gateway/serving/pinning.py)
            body["pinned_pool"] = gw.planner.pinned.status()
        if gw.siblings is not None:
            body["workers"] = gw.siblings.status()
        return JSONResponse(body, status_code=200 if ok else 503)

    for path, probe in (("/health", health), ("/ready", ready)):  # HEAD: its status, no body
        app.add_api_route(path, probe, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        gw: Gateway = request.app.state.gw
        if config.exposure.metrics_auth:
            require_monitoring(request, gw)
        text = gw.exposition()
        if gw.siblings is not None:  # --workers N: every worker's, merged
            text = await gw.siblings.merged_metrics(text)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.post("/debug/route")
    async def debug_route(request: Request) -> dict[str, Any]:
        """How many of a prompt's tokens are cached, without running it: the admin key's view
        (a tenant's key would make it a prompt-guessing oracle); `x-cachelane-tenant: NAME`
        explains it as that tenant. In auth.mode open, as the anonymous tenant."""
        gw: Gateway = request.app.state.gw
        tenant = debug_tenant(gw, request)
        body = await _read_json(request, gw.config.max_body_bytes)
        endpoint = "chat" if "messages" in body else "completions"
        endpoint = "responses" if "input" in body and "prompt" not in body else endpoint
        check_request(endpoint, body)  # the body as the endpoint itself would check it
        plan = await gw.planner.plan(endpoint, body, tenant, dry_run=True, headers=request.headers)
        return explain(plan) | {"load": gw.loads(), "costs": gw.learner.describe()}

    return app


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


async def _read_json(request: Request, max_bytes: int) -> dict[str, Any]:
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


async def _serve(request: Request, endpoint: str) -> Response:
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
        body = await _read_json(request, gw.config.max_body_bytes)
        check_fields(body, gw.denied_fields[tenant.tenant_class])
        check_request(endpoint, body)  # one schema for chat, completions, responses
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
        _count_decision(gw, plan)
        gw.prewarmer.consider(plan)
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
        return response
    except ApiError as err:
        status = err.status
        err.headers = _rate_limit_headers(budgets) | err.headers  # a refusal's own win
        raise
    finally:
        if reserved is not None:
            reserved.release()  # an error, or a client gone, before the proxy took it over
        label = model_label(model, gw.registry.known_models())
        gw.metrics.requests.labels(endpoint, label, str(status)).inc()
        e2e = gw.metrics.e2e_seconds.labels(endpoint, label)
        if relay is None:
            e2e.observe(time.perf_counter() - started)
        else:  # a stream ends when its last byte is sent, after this returns
            relay.on_finish(lambda: e2e.observe(time.perf_counter() - started))
        if tenant is not None:
            gw.metrics.tenant_requests.labels(
                tenant.name, tenant.tenant_class.value, str(status)
            ).inc()


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


def _count_auth_throttled(app: FastAPI) -> None:
    gw = getattr(app.state, "gw", None)
    if gw is not None:
        gw.metrics.auth_throttled.inc()
        gw.metrics.errors.labels("too_many_failed_auth").inc()


def _install_error_handlers(app: FastAPI) -> None:
    def metrics_of(request: Request) -> Metrics | None:
        gw = getattr(request.app.state, "gw", None)
        return gw.metrics if gw is not None else None

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        m = metrics_of(request)
        if m is not None:
            m.errors.labels(err.code).inc()
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        return await api_error(request, ApiError(err.status_code, str(err.detail), code=code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        return await api_error(request, bad_request(str(err.errors()), code="invalid_request"))

    app.add_middleware(_Unexpected)


Endpoint = Callable[[Request], Awaitable[Response]]


class _App(FastAPI):
    """FastAPI, with an ASGI entry ahead of it for POST /v1/chat/completions and /v1/completions
    (`hot`): in a CPU profile of the overhead benchmark's closed loop (docs/performance.md)
    Starlette's and FastAPI's layers (error middlewares, FastAPI's body-limit and telemetry
    wrappers, its exit stack, route matching, dependency solving) were ~11% of a request's gateway
    CPU. The entry is the app's ASGI `__call__`, the interface the server calls: a hot request
    goes to its endpoint through the middlewares the app was given (its public `user_middleware`:
    request ids and the access line, tracing, the 500 catcher, and any added later), wrapped in
    the order Starlette wraps them; an ApiError or HTTPException is rendered by the app's own
    exception handlers. Everything else, the lifespan included, goes to FastAPI as usual."""

    hot: dict[str, Endpoint]
    _hot_stack: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.hot:
            scope["app"] = self  # as Starlette sets it: request.app, the middlewares' state
            await (self._hot_stack or self._build_hot_stack())(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    def _build_hot_stack(self) -> ASGIApp:
        if self.middleware_stack is None:  # built now, so a late add_middleware fails loudly
            self.middleware_stack = self.build_middleware_stack()
        hot: ASGIApp = self._serve_hot
        for cls, args, kwargs in reversed(self.user_middleware):
            hot = cls(hot, *args, **kwargs)
        self._hot_stack = hot
        return hot

    async def _serve_hot(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await self.hot[scope["path"]](request)
        except (ApiError, StarletteHTTPException) as err:
            handler = next(
                self.exception_handlers[t]
                for t in type(err).__mro__
                if t in self.exception_handlers
            )
            answer = handler(request, err)
            response = await answer if inspect.isawaitable(answer) else answer
        await response(scope, receive, send)


class _Unexpected:
    """Any other exception: its traceback logged once (here), and a 500 in the error envelope,
    counted. An exception handler for Exception would run in Starlette's ServerErrorMiddleware,
    which re-raises after it, so uvicorn logged each traceback a second time; this middleware sits
    inside that one and does not re-raise. A response already under way cannot become a 500: it
    is cut off (uvicorn closes the connection)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            log.exception("unexpected error on %s", scope.get("path"))
            err = ApiError(
                500, "internal gateway error", code="internal_error", type="server_error"
            )
            gw = getattr(scope["app"].state, "gw", None)
            if gw is not None:
                gw.metrics.errors.labels(err.code).inc()
            if not started:
                await err.response()(scope, receive, send)
