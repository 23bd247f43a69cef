"""OpenTelemetry tracing (`tracing:` in the config; the [otel] extra): one SERVER span per request.

- The span continues the client's W3C `traceparent` (and `tracestate`) when one came, and its
  context goes to the replica in the upstream request's `traceparent` (`inject`), so vLLM's own
  spans (`--otlp-traces-endpoint`) hang under the gateway's.
- Its attributes say how the request was routed and what came of it: tenant, class, model,
  replica (the one that answered), reason, policy, the estimated TTFT and engine queue of that
  replica, expected and observed cached tokens, prompt tokens, the observed TTFT (streams), the
  wait in flow control's queue, the status and the error code. The outcome is read from the
  access line's record (gateway/telemetry/logs.py `Access`), filled in as the response goes out.
- Spans are exported over OTLP/HTTP (protobuf) in batches; `sample_ratio` samples new traces
  (a trace the client sampled stays sampled: ParentBased, as the OpenTelemetry SDK's default).
- Off (the default) costs nothing: the SDK is never imported, the request layer opens no span,
  and the hooks (`inject`, `note_plan`, `note_queue_wait`) return on one test of a module global.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.types import Message, Scope, Send

from gateway import __version__
from gateway.extras import OTEL_MODULES, missing_message, missing_modules
from gateway.telemetry import logs

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

    from gateway.config import TracingConfig
    from gateway.serving.planner import Plan

TRACE_HEADERS = (b"traceparent", b"tracestate")
ERROR_BODY_LIMIT = 65_536  # an error body is read this far for its code (as the access line's)

_propagator: Any = None  # a TraceContextTextMapPropagator once any app traces, else None


@dataclass
class _Notes:
    """What the request's handlers tell the span beyond the access record."""

    plan: Plan | None = None
    queue_wait_s: float | None = None


_notes: contextvars.ContextVar[_Notes | None] = contextvars.ContextVar(
    "cachelane_trace_notes", default=None
)


def inject(headers: dict[str, str]) -> None:
    """Add the current span's `traceparent` (and `tracestate`) to an upstream request's headers;
    nothing when tracing is off or no span is current."""
    if _propagator is not None:
        _propagator.inject(headers)


def note_plan(plan: Plan) -> None:
    """The routing decision, for the span's estimates (read when the request ends)."""
    notes = _notes.get()
    if notes is not None:
        notes.plan = plan


def note_queue_wait(waited_s: float) -> None:
    """Seconds the request waited in flow control's queue."""
    notes = _notes.get()
    if notes is not None:
        notes.queue_wait_s = waited_s


def check_installed() -> None:
    """Raise ValueError naming the [otel] extra when its modules are missing."""
    missing = missing_modules(OTEL_MODULES)
    if missing:
        raise ValueError(missing_message("tracing", "otel", missing))


@dataclass(frozen=True)
class Tracing:
    tracer: Tracer
    provider: TracerProvider  # shut down (its last spans flushed) when the app shuts down


def tracer_from(config: TracingConfig, exporter: SpanExporter | None = None) -> Tracing:
    """A tracer of its own provider (the process's global provider is left alone): spans
    sampled by `config.sample_ratio`, sent to `exporter` as each ends (tests: the SDK's
    InMemorySpanExporter) or, without one, in batches over OTLP/HTTP to `config.endpoint`
    (None: the exporter's own default, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
    http://localhost:4318/v1/traces). Makes `inject` propagate from now on."""
    check_installed()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    global _propagator
    resource = Resource.create(
        {"service.name": config.service_name, "service.version": __version__}
    )
    provider = TracerProvider(
        resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio))
    )
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint)))
    _propagator = TraceContextTextMapPropagator()
    return Tracing(provider.get_tracer("cachelane.gateway", __version__), provider)


class RequestSpan:
    """One SERVER span per request, probes (/health, /ready, /metrics) excepted, opened by
    gateway/http/request_layer.py around the app and its 500 catcher: inside the access record
    (which it reads when the response has ended) and the failed-auth limit (a request refused
    unread gets no span; a 401 the limit turns into a 429 is seen as the 401 the app sent). At the
    app's shutdown, the spans not yet exported are sent before the server is told the shutdown is
    complete (`lifespan_sent`)."""

    def __init__(self, tracer: Tracing) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self._tracer = tracer.tracer
        self._provider = tracer.provider
        self._server = SpanKind.SERVER
        self._error = Status(StatusCode.ERROR)

    @staticmethod
    def traces(scope: Scope) -> bool:
        return scope.get("path") not in logs.PROBE_PATHS

    async def run(self, scope: Scope, send: Send, inner: Callable[[Send], Awaitable[None]]) -> None:
        """`inner(send)` (the app, answering through `send`) under the request's span."""
        carrier = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope.get("headers", ())
            if k in TRACE_HEADERS
        }
        parent = _propagator.extract(carrier) if carrier else None
        method, path = scope.get("method", ""), scope.get("path", "")
        notes = _Notes()
        token = _notes.set(notes)
        status: int | None = None  # None: no response began (the client left first)
        error_body = bytearray()  # the access record's error code is parsed after the span ends

        async def sent(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif (status or 0) >= 400 and len(error_body) < ERROR_BODY_LIMIT:
                error_body.extend(message.get("body", b"")[: ERROR_BODY_LIMIT - len(error_body)])
            await send(message)

        try:
            with self._tracer.start_as_current_span(
                f"{method} {path}",
                context=parent,
                kind=self._server,
                attributes={"http.request.method": method, "url.path": path},
            ) as span:
                try:
                    await inner(sent)
                finally:
                    if span.is_recording():
                        span.set_attributes(_attributes(status, logs.current_access(), notes))
                        if error_body and (code := _error_code(bytes(error_body))) is not None:
                            span.set_attribute("cachelane.error_code", code)
                        if (status or 0) >= 500:
                            span.set_status(self._error)
        finally:
            _notes.reset(token)

    async def lifespan_sent(self, send: Send, message: Message) -> None:
        if message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
            await asyncio.to_thread(self._provider.shutdown)  # the exporter blocks: a thread
        await send(message)


def _attributes(status: int | None, access: logs.Access | None, notes: _Notes) -> dict[str, Any]:
    out: dict[str, Any] = {} if status is None else {"http.response.status_code": status}
    if access is not None:
        out["cachelane.request_id"] = access.request_id
        fields = {
            "cachelane.tenant": access.tenant,
            "cachelane.tenant_class": access.tenant_class,
            "gen_ai.request.model": access.model,
            "cachelane.replica": access.replica,
            "cachelane.reason": access.reason,
            "cachelane.ttft_ms": access.ttft_ms,
            "cachelane.prompt_tokens": access.prompt_tokens,
            "cachelane.cached_tokens": access.cached_tokens,  # the engine's usage: observed
            "cachelane.expected_cached_tokens": access.expected_cached_tokens,
        }
        out |= {k: v for k, v in fields.items() if v is not None}
    plan = notes.plan
    if plan is not None:
        d = plan.decision
        out["cachelane.policy"] = d.policy.value
        replica = access.replica if access is not None and access.replica else d.replica
        score = next((s for s in d.scores if s.replica == replica), None)
        if score is not None:  # the estimate for the replica that answered
            out["cachelane.est_ttft_ms"] = round(score.estimate.ttft_s * 1000, 3)
            out["cachelane.est_queue_ms"] = round(score.estimate.queue_s * 1000, 3)
            out["cachelane.expected_cached_tokens"] = score.expected_cached_tokens
    if notes.queue_wait_s is not None:
        out["cachelane.queue_wait_ms"] = round(notes.queue_wait_s * 1000, 3)
    return out


def _error_code(body: bytes) -> str | None:
    """The OpenAI envelope's `error.code` (else `error.type`)."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    code = error.get("code") or error.get("type") if isinstance(error, dict) else None
    return str(code) if code is not None else None
