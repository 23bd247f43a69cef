"""OpenTelemetry tracing on real servers: simulated replicas that record the
headers they are sent, a gateway through uvicorn with `tracing.enabled` and the SDK's
InMemorySpanExporter, the official openai client.

- one SERVER span per request, streamed or not, with the routing decision and its outcome
  (tenant, class, replica, reason, estimated TTFT and queue, expected and observed cached tokens,
  flow control's queue wait, status);
- the replica gets a `traceparent` whose parent is that span; a client's `traceparent` is
  continued (same trace, the client's span as parent), and a trace it sampled stays sampled
  when the gateway samples nothing of its own;
- errors are spans too (status, error code); probes are not;
- off by default: no traceparent reaches the replica, and the SDK is never imported.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.http.app import create_app
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from tests.helpers.completions import streamed_usage
from tests.helpers.servers import running_app
from tests.integration.fleet import FAST_COSTS, MODEL, gateway_config
from tests.integration.test_exposure import BAD, CHAT, GOOD, TENANTS
from tests.integration.test_failing_replicas import until
from tests.integration.test_request_logs import HeaderCapture, captured_replicas

MESSAGES: Any = [{"role": "user", "content": "You are a helpful assistant. " * 20}]
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@asynccontextmanager
async def traced_fleet(
    n: int = 2, **tracing: Any
) -> AsyncIterator[tuple[str, list[HeaderCapture], InMemorySpanExporter]]:
    async with AsyncExitStack() as stack:
        urls, captures = await captured_replicas(stack, n)
        exporter = InMemorySpanExporter()
        config = gateway_config(urls, tracing={"enabled": True, **tracing})
        app = create_app(config, span_exporter=exporter)
        yield await stack.enter_async_context(running_app(app)), captures, exporter


@asynccontextmanager
async def openai_client(url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        yield client


async def ask_with_client_traceparent(client: openai.AsyncOpenAI) -> None:
    """A 2-token completion whose request carries the client's sampled traceparent."""
    await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        extra_headers={"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"},
    )


def traceparents(captures: list[HeaderCapture]) -> list[str | None]:
    return [h.get("traceparent") for c in captures for h in c.seen]


def parts(traceparent: str | None) -> tuple[str, str, str]:
    assert traceparent is not None
    version, trace_id, parent_id, flags = traceparent.split("-")
    assert version == "00"
    return trace_id, parent_id, flags


def number(attributes: Mapping[str, object], key: str) -> float:
    value = attributes[key]
    assert isinstance(value, int | float), (key, value)
    return value


def sampled(flags: str) -> bool:
    return bool(int(flags, 16) & 0x01)  # W3C trace-flags: bit 0 sampled (bit 1: random id)


def ids(span: ReadableSpan) -> tuple[str, str]:
    assert span.context is not None
    return f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"


async def test_each_request_is_a_span_with_its_route_and_outcome_and_the_replica_continues_it() -> (
    None
):
    async with traced_fleet(service_name="gw-under-test") as (url, captures, exporter):
        async with openai_client(url) as client:
            whole = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=MESSAGES, max_tokens=4
            )
            usage = await streamed_usage(client, MODEL, MESSAGES)
            assert usage is not None and usage.prompt_tokens_details is not None
            observed_cached = usage.prompt_tokens_details.cached_tokens
            assert observed_cached is not None and observed_cached > 0  # the same prompt again

            # a span ends when its response has ended, a moment after the client read the last byte
            await until(lambda: len(exporter.get_finished_spans()) == 2)
            spans = exporter.get_finished_spans()
            sent = traceparents(captures)
            assert len(sent) == 2
            for span, traceparent in zip(spans, sent, strict=True):
                assert span.kind is SpanKind.SERVER
                assert span.name == "POST /v1/chat/completions"
                assert span.resource.attributes["service.name"] == "gw-under-test"
                assert span.parent is None  # the client sent no traceparent: a new trace
                trace_id, parent_id, flags = parts(traceparent)
                assert (trace_id, parent_id) == ids(span)  # the replica's parent is this span
                assert sampled(flags)  # sample_ratio 1.0
                a = span.attributes
                assert a is not None
                assert a["http.response.status_code"] == 200
                assert a["cachelane.tenant"] == "anonymous"
                assert a["cachelane.tenant_class"] == "standard"
                assert a["gen_ai.request.model"] == MODEL
                assert a["cachelane.replica"] in {c.seen[0]["host"] for c in captures if c.seen}
                assert a["cachelane.reason"]
                assert a["cachelane.policy"] == "cache_aware"
                assert (
                    isinstance(a["cachelane.est_ttft_ms"], float) and a["cachelane.est_ttft_ms"] > 0
                )
                assert isinstance(a["cachelane.est_queue_ms"], float)
                assert isinstance(a["cachelane.expected_cached_tokens"], int)
                assert (
                    isinstance(a["cachelane.prompt_tokens"], int)
                    and a["cachelane.prompt_tokens"] > 0
                )
                assert isinstance(a["cachelane.queue_wait_ms"], float)  # flow control's (0: none)
                assert len(str(a["cachelane.request_id"])) == 32
            first, second = (s.attributes for s in spans)
            assert first is not None and second is not None
            assert first["cachelane.request_id"] == whole.headers["x-request-id"]
            assert first["cachelane.cached_tokens"] == 0  # observed: the engine's usage
            assert second["cachelane.cached_tokens"] == observed_cached
            assert number(second, "cachelane.expected_cached_tokens") > 0  # routed to the prefix
            assert "cachelane.ttft_ms" not in first and number(second, "cachelane.ttft_ms") > 0


async def test_a_client_traceparent_is_continued_and_its_sampling_kept() -> None:
    # sample_ratio 0: the gateway starts no sampled trace of its own, yet keeps the client's
    async with traced_fleet(1, sample_ratio=0.0) as (url, captures, exporter):
        async with openai_client(url) as client:
            await ask_with_client_traceparent(client)
            await until(lambda: len(exporter.get_finished_spans()) == 1)
            [span] = exporter.get_finished_spans()
            trace_id, span_id = ids(span)
            assert trace_id == CLIENT_TRACE_ID
            assert span.parent is not None and span.parent.is_remote
            assert f"{span.parent.span_id:016x}" == CLIENT_SPAN_ID
            trace_id, parent_id, flags = parts(traceparents(captures)[0])
            assert (trace_id, parent_id) == (CLIENT_TRACE_ID, span_id) and sampled(flags)

            # without one: not sampled, no span exported, the replica told so (not sampled)
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
            await until(lambda: len(captures[0].seen) == 2)
            await asyncio.sleep(0.2)  # time for a span to end, if one were recorded
            assert len(exporter.get_finished_spans()) == 1
            trace_id, _, flags = parts(traceparents(captures)[1])
            assert trace_id != CLIENT_TRACE_ID and not sampled(flags)


def otlp_receiver(received: list[ExportTraceServiceRequest]) -> Starlette:
    """An OTLP/HTTP collector's traces endpoint (protobuf): keeps every export request."""

    async def traces(request: Request) -> Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.body())
        received.append(message)
        answer = ExportTraceServiceResponse().SerializeToString()
        return Response(answer, media_type="application/x-protobuf")

    return Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])


def otlp_value(value: AnyValue) -> object:
    return getattr(value, value.WhichOneof("value") or "string_value")


async def test_spans_go_over_otlp_http_and_the_last_ones_are_flushed_at_shutdown() -> None:
    received: list[ExportTraceServiceRequest] = []
    async with AsyncExitStack() as stack:
        collector = await stack.enter_async_context(running_app(otlp_receiver(received)))
        spec = SimReplicaSpec(name="sim-0", port=0, costs=FAST_COSTS, itl_s=0.001)
        replica = await stack.enter_async_context(running_app(create_sim_app(spec)))
        tracing = {"enabled": True, "endpoint": f"{collector}/v1/traces", "service_name": "gw"}
        app = create_app(gateway_config([replica], tracing=tracing))  # the OTLP exporter
        async with running_app(app) as url:
            async with openai_client(url) as client:
                for stream in (False, True):
                    answer = await client.chat.completions.create(
                        model=MODEL, messages=MESSAGES, max_tokens=2, stream=stream
                    )
                    if stream:
                        async for _ in answer:  # type: ignore[union-attr]
                            pass
        # the gateway has shut down; the batch processor's 5 s delay had not passed: the spans
        # arrived because the shutdown flushed them
        resources = [rs for r in received for rs in r.resource_spans]
        spans = [s for rs in resources for ss in rs.scope_spans for s in ss.spans]
        assert len(spans) == 2
        services = {
            otlp_value(kv.value) for rs in resources for kv in rs.resource.attributes
            if kv.key == "service.name"
        }  # fmt: skip
        assert services == {"gw"}
        for span in spans:
            attributes = {kv.key: otlp_value(kv.value) for kv in span.attributes}
            assert attributes["cachelane.replica"] == replica.removeprefix("http://")
            assert attributes["http.response.status_code"] == 200
            assert attributes["gen_ai.request.model"] == MODEL
            assert isinstance(attributes["cachelane.est_ttft_ms"], float)


async def test_errors_are_spans_and_probes_are_not() -> None:
    async with traced_fleet(1) as (url, captures, exporter):
        async with httpx.AsyncClient(timeout=10.0) as h:
            for probe in ("/health", "/ready", "/metrics"):
                assert (await h.get(url + probe)).status_code == 200
            bad = await h.post(f"{url}/v1/chat/completions", content=b"{not json")
            missing = await h.post(
                f"{url}/v1/chat/completions",
                json={"model": "no-such-model", "messages": MESSAGES},
            )
        assert bad.status_code == 400 and missing.status_code == 404
        await until(lambda: len(exporter.get_finished_spans()) >= 2)
        spans = exporter.get_finished_spans()
        assert [s.name for s in spans] == ["POST /v1/chat/completions"] * 2
        codes = [(s.attributes or {}).get("cachelane.error_code") for s in spans]
        statuses = [(s.attributes or {}).get("http.response.status_code") for s in spans]
        assert statuses == [400, 404]
        assert all(codes)
        assert captures[0].seen == []


async def test_a_500_and_the_401s_of_the_failed_auth_limit_are_spans_a_refusal_is_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With tracing on the request layer runs the span inside the access record and the
    failed-auth limit, around the 500 catcher: the catcher's 500 is the span's status, a 401
    that the limit turns into a 429 is seen as the 401 it was, and a request refused unread
    has no span; the access line logs every one of them."""
    async with AsyncExitStack() as stack:
        urls, _ = await captured_replicas(stack, 1)
        exporter = InMemorySpanExporter()
        config = gateway_config(
            urls, tracing={"enabled": True}, tenants=TENANTS,
            rate_limits={"failed_auth_per_min": 1},
        )  # fmt: skip
        app = create_app(config, span_exporter=exporter)
        url = await stack.enter_async_context(running_app(app))

        async def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("planted")

        app.state.gw.planner.plan = broken
        caplog.set_level(logging.INFO, logger="cachelane.access")
        async with httpx.AsyncClient(base_url=url, timeout=10.0) as h:
            failed = await h.post("/v1/chat/completions", json=CHAT, headers=GOOD)
            bad = [
                (await h.post("/v1/chat/completions", json=CHAT, headers=BAD)).status_code
                for _ in range(2)
            ]
            unread = await h.post("/v1/chat/completions", json=CHAT)
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "internal_error"
        assert bad == [401, 429] and unread.status_code == 429
        await until(lambda: len(exporter.get_finished_spans()) >= 3)
        spans = exporter.get_finished_spans()
        seen = [
            (
                (s.attributes or {}).get("http.response.status_code"),
                (s.attributes or {}).get("cachelane.error_code"),
                s.status.status_code,
            )
            for s in spans
        ]
        assert seen == [
            (500, "internal_error", StatusCode.ERROR),
            (401, "invalid_api_key", StatusCode.UNSET),
            (401, "invalid_api_key", StatusCode.UNSET),
        ]
        lines = [r.__dict__["access"] for r in caplog.records if r.name == "cachelane.access"]
        assert [line["status"] for line in lines] == [500, 401, 429, 429]


async def test_tracing_is_off_by_default_and_sends_no_traceparent() -> None:
    async with AsyncExitStack() as stack:
        spec = SimReplicaSpec(name="sim-0", port=0, costs=FAST_COSTS, itl_s=0.001)
        capture = HeaderCapture(create_sim_app(spec))
        replica = await stack.enter_async_context(running_app(capture))
        config = gateway_config([replica])
        assert not config.tracing.enabled
        url = await stack.enter_async_context(running_app(create_app(config)))
        async with openai_client(url) as client:
            await ask_with_client_traceparent(client)
            assert traceparents([capture]) == [None]  # neither made nor passed on


def test_the_sdk_is_not_imported_when_tracing_is_off() -> None:
    code = (
        "import sys\n"
        "from gateway.http.app import create_app\n"
        "from tests.integration.fleet import gateway_config\n"
        "create_app(gateway_config(['http://127.0.0.1:9']))\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"
