"""The FastAPI app: OpenAI endpoints in front of the replicas, plus health, readiness, metrics
and /debug/route. Built by `create_app(config)`; the lifespan owns every long-lived resource.
The routes live beside it: gateway/http/serve.py (the OpenAI endpoints' request path),
status_routes.py, debug_routes.py, responses_routes.py; admin and costs in their rooms."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import __version__
from gateway.accounting.ledger import costs_router
from gateway.components import start_all
from gateway.config import GatewayConfig
from gateway.http.debug_routes import debug_router
from gateway.http.errors import ApiError, bad_request
from gateway.http.exposure import POLICY_STATE_KEY, AuthFailures, ConnectionPolicy
from gateway.http.openapi import schema_of
from gateway.http.request_layer import RequestLayer
from gateway.http.responses_routes import responses_router
from gateway.http.serve import api_router, chat_completions, completions
from gateway.http.status_routes import status_router
from gateway.telemetry import logs, tracing
from gateway.telemetry.banner import OPEN_WARNING, startup_banner
from gateway.telemetry.metrics import Metrics
from gateway.tenancy.admin import admin_router
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
            _log_banner(gw)
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
    _add_request_middleware(app, config, span_exporter)
    app.include_router(admin_router)
    app.include_router(costs_router)  # GET /debug/costs, with the admin key
    app.include_router(responses_router)  # GET, DELETE /v1/responses/{id}, and its cancel

    # The two hot endpoints skip the framework's layers (_App.__call__); these routes give the other
    # methods their 405 and list them in the route table.
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.hot = {"/v1/chat/completions": chat_completions, "/v1/completions": completions}
    app.include_router(api_router)  # POST /v1/embeddings, /v1/responses
    app.include_router(status_router)  # /v1/models, /health, /ready, /metrics
    app.include_router(debug_router)  # POST /debug/route

    return app


def _log_banner(gw: Any) -> None:
    """One line with how the gateway is set up, once it serves (and a warning in open mode)."""
    counts: dict[str, tuple[int, int]] = {}
    for r in gw.registry.replicas.values():
        up, total = counts.get(r.pool.name, (0, 0))
        counts[r.pool.name] = (up + r.healthy, total + 1)
    pid = None if gw.siblings is None else gw.siblings.status()["pid"]
    log.info("%s", startup_banner(gw.config, counts, len(gw.tenants.list()), pid))
    if gw.config.auth.mode == "open":
        log.warning("%s", OPEN_WARNING)


def _add_request_middleware(
    app: FastAPI, config: GatewayConfig, span_exporter: SpanExporter | None
) -> None:
    """The request id and access line, the failed-auth limit, the span (with tracing on), the
    body's deadline and the 500 catcher: one layer (gateway/http/request_layer.py)."""

    def on_timeout(part: str) -> None:
        app.state.gw.metrics.read_timeouts.labels(part).inc()

    app.state.auth_failures = AuthFailures(config.rate_limits.failed_auth_per_min)
    span = None
    if config.tracing.enabled:
        span = tracing.RequestSpan(tracing.tracer_from(config.tracing, span_exporter))
    app.add_middleware(
        RequestLayer,
        body_timeout_s=config.listen.body_timeout_s,
        on_timeout=on_timeout,
        failures=app.state.auth_failures,
        on_refused=lambda: _count_auth_throttled(app),
        span=span,
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


Endpoint = Callable[[Request], Awaitable[Response]]


class _App(FastAPI):
    """FastAPI, with an ASGI entry ahead of it for POST /v1/chat/completions and /v1/completions
    (`hot`): in a CPU profile of the overhead benchmark's closed loop (docs/performance.md)
    Starlette's and FastAPI's layers (error middlewares, FastAPI's body-limit and telemetry
    wrappers, its exit stack, route matching, dependency solving) were ~11% of a request's
    gateway CPU. The entry is the app's ASGI `__call__`, the interface the server calls: a hot
    request goes to its endpoint through the middlewares the app was given (its public
    `user_middleware`: gateway/http/request_layer.py's one layer, and any added later), wrapped
    in the order Starlette wraps them; an ApiError or HTTPException is rendered by the app's own
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
