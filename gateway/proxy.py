"""Send a planned request to its replica and relay the answer, streaming byte for byte.

Retries: when the chosen replica cannot be reached before the first byte (refused, reset, stale
keep-alive), or sends no first byte of a streamed answer within its pool's first_byte_timeout_s
(the request is cancelled there), the next replica in the decision's ranking is tried, at most
`retries` times; an unreachable replica is ejected at once and re-admitted by the health checker.
Once the replica has answered, its status and body pass through as they are (4xx and 5xx
included). Passive health (Registry.answered, Registry.errored): 5xx answers and first-byte
timeouts in a row eject a replica, like Envoy's outlier detection.

A client that leaves before its answer began (polled through `client_gone`) has its upstream
request cancelled: the connection is closed, which makes vLLM abort the request.

Every path releases the load it reserved: `Reservation.release()` is synchronous and idempotent
and runs in `finally`, so success, client disconnect (the relay task is cancelled) and upstream
failure all give the slot back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from functools import partial
from typing import Any

import anyio
import orjson
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway import logs, slo, tracing
from gateway.calibration import CostLearner, Observation
from gateway.capture import Capture
from gateway.costs import CostAccounting
from gateway.disconnect import ClientGone, while_client_waits
from gateway.errors import ApiError, no_replica, upstream_error
from gateway.metrics import Metrics
from gateway.planner import Plan, Planner
from gateway.registry import Registry, Replica, Reservation
from gateway.relay_time import RelayTime
from gateway.upstream import (
    Upstream,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
)
from routing.cost import Estimate

log = logging.getLogger("cachelane.proxy")

_RETRYABLE = (UpstreamConnectError, UpstreamDisconnected)  # before the first byte
NAMESPACE_HEADER = "x-cachelane-namespace"  # the simulator hashes blocks in this namespace
REMOTE_WRITE_HEADER = "x-cachelane-remote-write"  # "0": do not write this KV to the remote tier


ENDPOINT_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
}

_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')


def cached_tokens_in(chunk: bytes) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` if this piece of a response carries it."""
    if b"cached_tokens" not in chunk:
        return None
    match = _CACHED_TOKENS.search(chunk)
    return int(match.group(1)) if match else None


def prompt_tokens_in(chunk: bytes) -> int | None:
    """`usage.prompt_tokens` (/v1/responses: `input_tokens`) if this piece of a response
    carries it."""
    if b"_tokens" not in chunk:
        return None
    match = _PROMPT_TOKENS.search(chunk)
    return int(match.group(1)) if match else None


def decision_headers(
    plan: Plan, replica: Replica, sent_s: float, relay_s: float = 0.0
) -> dict[str, str]:
    """The decision, and the TTFT the client can expect: the time the request spent in the
    gateway before it was sent at `sent_s` (measured), the replica's estimate, then `relay_s`,
    the gateway's recent time to hand a first chunk on (gateway/relay_time.py)."""
    score = plan.decision.score(replica.name)
    gateway_s = plan.in_gateway_s(sent_s)
    est_s = gateway_s + score.estimate.ttft_s + relay_s
    headers = {
        "x-cachelane-replica": replica.name,
        "x-cachelane-reason": plan.decision.reason.value,
        "x-cachelane-est-ttft-ms": f"{est_s * 1000:.1f}",
        "x-cachelane-est-terms-ms": estimate_terms(score.estimate, gateway_s, relay_s),
        "x-cachelane-expected-cached-tokens": str(score.expected_cached_tokens),
        "x-cachelane-tenant-class": plan.tenant.tenant_class.value,
    }
    if plan.fallback is not None:
        headers["x-cachelane-fallback"] = plan.fallback.value
    if plan.admission is not None:
        headers[REMOTE_WRITE_HEADER] = "1" if plan.admission.write else "0"
    return headers


def estimate_terms(e: Estimate, gateway_s: float = 0.0, relay_s: float = 0.0) -> str:
    """The estimate's terms, e.g. "gateway=0.8,fixed=3.0,load=0.0,queue=12.5,prefill=40.1,
    relay=0.6" (ms): gateway is the time the request spent in the gateway before it was sent
    (measured), load the KV swap-in and fetch before it waits for the prefill, queue that wait,
    relay the gateway's recent time from a replica's first byte to the client's first chunk."""
    prefill_s = e.prefill_s + (0.0 if e.remote_fetch else e.remote_s)
    parts = (
        ("gateway", gateway_s),
        ("fixed", e.fixed_s),
        ("load", e.load_s),
        ("queue", e.queue_s),
        ("prefill", prefill_s),
        ("relay", relay_s),
    )
    return ",".join(f"{name}={value * 1000:.1f}" for name, value in parts)


def upstream_request_headers(plan: Plan) -> dict[str, str]:
    headers = {"content-type": "application/json", NAMESPACE_HEADER: plan.namespace}
    headers.update(logs.upstream_headers())  # x-request-id
    tracing.inject(headers)  # traceparent, when tracing is on
    if plan.admission is not None:
        headers[REMOTE_WRITE_HEADER] = "1" if plan.admission.write else "0"
    return headers


def upstream_body(plan: Plan, replica: Replica, raw_body: bytes) -> bytes:
    """The client's bytes as they came, unless the pool isolates tenants with vLLM's cache_salt
    or schedules by the class's priority."""
    extra: dict[str, Any] = {}
    if replica.pool.cache_salt and plan.endpoint != "embeddings":  # vLLM's pooling takes none
        extra["cache_salt"] = plan.cache_salt
    priority = plan.engine_priority(replica)
    if priority is not None:
        extra["priority"] = priority
    if not extra:
        return raw_body
    body = {**plan.body, **extra}
    try:
        return orjson.dumps(body)
    except TypeError:  # an integer beyond 64 bits (the body parser keeps them exact)
        return json.dumps(body).encode()


def _upstream_headers(resp: UpstreamResponse) -> dict[str, str]:
    content_type = resp.content_type
    return {} if content_type is None else {"content-type": content_type}


class Proxy:
    def __init__(
        self,
        upstream: Upstream,
        registry: Registry,
        planner: Planner,
        metrics: Metrics,
        learner: CostLearner,
        *,
        retries: int,
        costs: CostAccounting | None = None,
        capture: Capture | None = None,
    ) -> None:
        self._upstream = upstream
        self._registry = registry
        self._planner = planner
        self._metrics = metrics
        self._learner = learner
        self._retries = retries
        self._costs = costs  # cost accounting (gateway/costs.py), when the gateway keeps it
        # told every answer's usage (its last chunk that carried one, or None): rate limits
        self.usage_hook: Callable[[Plan, bytes | None], None] | None = None
        self._capture = capture  # the traffic capture (gateway/capture.py), when configured
        self._relay_time = RelayTime()

    async def forward(
        self,
        endpoint: str,
        raw_body: bytes,
        plan: Plan,
        *,
        client_gone: Callable[[], Awaitable[bool]] | None = None,
        reserved: Reservation | None = None,
    ) -> Response:
        """Send a planned request to its replica and return the replica's answer.

        `endpoint`: "chat" or "completions" (the upstream path); `raw_body`: the client's bytes,
        forwarded unchanged unless the replica's pool adds fields (vLLM's cache_salt, the
        class's priority: upstream_body); `plan`: Planner.plan's output; `client_gone`: asked
        every gateway.disconnect.DISCONNECT_POLL_S until the answer is ready (Starlette's
        `Request.is_disconnected`): once the client has left, the upstream request is
        cancelled, its reservation released, and ApiError 499 raised; `reserved`: the first
        choice's reservation made with the decision (reserve_first), sent on and then released
        like any other (a caller releases it if forward() never took it: `Reservation.taken`).

        Replicas are tried in the decision's ranking, skipping unhealthy ones; each try reserves
        load on the replica; a replica that accepts the request (status < 400) has the prompt
        recorded in the index (Planner.record_sent). A replica that cannot be reached before its
        first byte is marked failed (ejected if no connection could be made) and the next one is
        tried, at most `retries` more times; so is one that sends no first byte of a streamed
        answer within its pool's `first_byte_timeout_s` (the request is cancelled there, and it
        counts a passive error, as does a 5xx answer: Registry.answered).

        Returns a StreamingResponse for a streamed request the replica accepted (the reservation
        is released and the TTFT learned when the stream ends, however it ends), otherwise the
        whole body as a Response; the replica's status passes through (4xx and 5xx included).
        Raises ApiError: 502 or 504 (upstream_error) when every replica tried was unreachable or
        silent, or when one failed or timed out in a way a retry cannot mend (after the request
        may have reached it); 503 (no_replica) when no replica in the ranking was healthy; 499
        when the client left first. Any other exception propagates after the reservation is
        released.
        """
        if client_gone is None:
            return await self._forward(endpoint, raw_body, plan, reserved)
        try:
            return await while_client_waits(
                self._forward(endpoint, raw_body, plan, reserved),
                client_gone,
                abandoned=_close_abandoned,
            )
        except ClientGone:
            self._metrics.client_gone.inc()
            raise ApiError(
                499, "the client closed the request before it was answered", code="client_closed"
            ) from None

    async def _forward(
        self, endpoint: str, raw_body: bytes, plan: Plan, reserved: Reservation | None
    ) -> Response:
        path = ENDPOINT_PATHS[endpoint]
        last_error: UpstreamError | None = None
        attempts = 0
        for name in plan.decision.ranking:
            replica = plan.replicas[name]
            mine = reserved is not None and reserved.replica is replica and not reserved.taken
            if not replica.healthy and not mine:
                continue
            if attempts > self._retries:
                break
            attempts += 1
            if mine and reserved is not None:
                reservation = reserved
                reservation.taken = True
                reservation.started_s = time.perf_counter()  # sent now: the TTFT counts from here
            else:
                reservation = self._reserve(plan, replica)
            url = replica.url + path
            body = upstream_body(plan, replica, raw_body)
            headers = upstream_request_headers(plan)
            # a streamed answer's first byte is its first token; a whole answer's first byte
            # comes after the whole generation, so only upstream.read_timeout_s bounds it
            timeout_s = replica.pool.first_byte_timeout_s if plan.stream else None
            resp: UpstreamResponse | None = None
            chunks: AsyncIterator[bytes] | None = None
            first: bytes | None = None
            try:
                async with asyncio.timeout(timeout_s):
                    resp = await self._upstream.post(url, body, headers)
                    if resp.status < 400:  # only a replica that took it holds its prompt
                        await self._planner.record_sent(plan, replica)
                        if self._costs is not None:
                            self._costs.sent(plan, replica)
                        if plan.stream:
                            chunks = resp.chunks()
                            first = await anext(chunks, None)
            except TimeoutError:
                await _discard(resp, reservation)
                silent = UpstreamTimeout(f"no first byte in {timeout_s} s")
                # 504 if no other replica answers
                await self._registry.errored(replica, repr(silent), reason="timeout")
                self._metrics.retries.labels(replica.name).inc()
                log.warning(
                    "replica %s sent no first byte in %s s, trying the next one",
                    replica.name,
                    timeout_s,
                )
                last_error = silent
                continue
            except _RETRYABLE as err:
                await _discard(resp, reservation)
                await self._registry.mark_failed(
                    replica,
                    repr(err),
                    eject=isinstance(err, UpstreamConnectError),
                    reason="connect",
                )
                self._metrics.retries.labels(replica.name).inc()
                log.warning("replica %s unreachable (%r), trying the next one", replica.name, err)
                last_error = err
                continue
            except BaseException as err:
                await _discard(resp, reservation)
                if isinstance(err, UpstreamTimeout):
                    await self._registry.errored(replica, repr(err), reason="timeout")
                if isinstance(err, UpstreamError):
                    raise upstream_error(replica.name, err) from err
                raise
            await self._registry.answered(replica, resp.status)
            relay_s = self._relay_time.seconds if chunks is not None else 0.0
            headers = _upstream_headers(resp) | decision_headers(
                plan, replica, reservation.started_s, relay_s
            )
            if chunks is not None:
                headers["cache-control"] = "no-cache"
                headers["x-accel-buffering"] = "no"
                ttft_s = None if first is None else self._first_byte(reservation, plan)
                if first is not None:  # its prefill is done: what it loaded is in HBM now
                    await self._planner.record_loaded(plan, replica)
                return RelayResponse(
                    self._relay(resp, chunks, first, ttft_s, reservation, plan),
                    on_close=partial(_close, resp, reservation),
                    status_code=resp.status,
                    headers=headers,
                )
            try:
                content = await resp.read()
            except UpstreamError as err:
                raise upstream_error(replica.name, err) from err
            finally:
                ttft_s = self._first_byte(reservation, plan)
                reservation.release()
                await resp.aclose()
            if resp.status < 400:
                self._count_usage(plan, replica, prompt_tokens_in(content), content)
                if self._costs is not None:  # a whole answer's first byte is no TTFT
                    observed_s = ttft_s if _prefill_only(plan) else None
                    self._costs.answered(
                        plan,
                        replica,
                        observed_s,
                        cached_tokens_in(content),
                        prompt_tokens_in(content),
                    )
                if self._capture is not None:
                    self._capture.answered(
                        plan,
                        reservation,
                        status=resp.status,
                        ttft_s=ttft_s if _prefill_only(plan) else None,
                        cached_tokens=cached_tokens_in(content),
                        prompt_tokens=prompt_tokens_in(content),
                    )
            if _prefill_only(plan) and resp.status < 400:
                self._learn(reservation, plan, ttft_s, cached_tokens_in(content))
            return Response(content, status_code=resp.status, headers=headers)
        if last_error is not None:
            raise upstream_error(plan.decision.replica, last_error)
        raise no_replica(plan.model)

    def reserve_first(self, plan: Plan) -> Reservation | None:
        """Reserve the decision's first healthy choice now (None: none is healthy). Called in
        the decision's own step of the event loop: a request decided in the same step (a burst
        read at once after a stall) then sees this one's load instead of the same idle replica.
        The caller hands it to forward(), or releases it."""
        for name in plan.decision.ranking:
            replica = plan.replicas[name]
            if replica.healthy:
                return self._reserve(plan, replica)
        return None

    def _reserve(self, plan: Plan, replica: Replica) -> Reservation:
        score = plan.decision.score(replica.name)
        prefill = score.overlap.prompt_tokens - score.expected_cached_tokens
        swaps = 1 if score.overlap.cpu_tokens else 0
        return self._registry.reserve(
            replica,
            prefill_tokens=prefill,
            swaps=swaps,
            load_s=score.estimate.load_s,
            priority=plan.engine_priority(replica),
        )

    def _first_byte(self, reservation: Reservation, plan: Plan) -> float:
        ttft_s = reservation.first_byte()
        replica = reservation.replica
        if plan.stream:  # a whole answer's first byte comes after the whole generation
            self._metrics.ttft_seconds.labels(replica.name, plan.model).observe(ttft_s)
            tenant = plan.tenant
            self._metrics.tenant_ttft_seconds.labels(
                tenant.name, tenant.tenant_class.value
            ).observe(ttft_s)
        score = plan.decision.score(replica.name)
        self._metrics.estimated_queue.labels(replica.name).observe(score.estimate.queue_s)
        slo.observe_first_byte(self._metrics, plan, reservation.started_s, ttft_s)
        return ttft_s

    def _count_usage(
        self, plan: Plan, replica: Replica, prompt: int | None, last: bytes | None
    ) -> None:
        """The engine's `usage` (the last one a stream sent): cachelane_prompt_tokens and
        cachelane_cached_tokens, whose ratio is the observed hit rate. An answer without usage
        (a stream without include_usage) counts nothing; one without cached_tokens counts 0."""
        if self.usage_hook is not None:
            self.usage_hook(plan, last)
        if prompt is None:
            return
        cached = (cached_tokens_in(last) if last is not None else None) or 0
        labels = (replica.name, plan.tenant.name, plan.model)
        self._metrics.prompt_tokens.labels(*labels).inc(prompt)
        self._metrics.cached_tokens.labels(*labels).inc(min(cached, prompt))

    def _learn(
        self, reservation: Reservation, plan: Plan, ttft_s: float, cached: int | None
    ) -> None:
        replica = reservation.replica
        score = plan.decision.score(replica.name)
        self._learner.observe(Observation(replica, score, ttft_s, cached))

    async def _relay(
        self,
        resp: UpstreamResponse,
        chunks: AsyncIterator[bytes],
        first: bytes | None,
        ttft_s: float | None,
        reservation: Reservation,
        plan: Plan,
    ) -> AsyncIterator[bytes]:
        """Relay the stream byte for byte, from its first chunk (read before the response was
        returned, within the first-byte timeout); the TTFT is learned from when it ends (the
        engine's usage, if the client asked for it, comes in the last chunk), however it ends."""
        cached: int | None = None
        prompt: int | None = None
        usage: bytes | None = None  # the last chunk that carried usage
        try:
            if first is not None:
                cached = cached_tokens_in(first)
                prompt = prompt_tokens_in(first)
                usage = first if prompt is not None else None
                yield first
                if reservation.first_byte_s is not None:  # handed on: the way back is measured
                    self._relay_time.observe(time.perf_counter() - reservation.first_byte_s)
                async for chunk in chunks:
                    found = cached_tokens_in(chunk)
                    if found is not None:
                        cached = found
                    if (tokens := prompt_tokens_in(chunk)) is not None:
                        prompt, usage = tokens, chunk
                    yield chunk
        except UpstreamError as err:
            api_error: ApiError = upstream_error(reservation.replica.name, err)
            self._metrics.errors.labels(api_error.code).inc()
            log.warning("stream from %s broke: %r", reservation.replica.name, err)
            yield f"data: {json.dumps(api_error.envelope())}\n\n".encode()
        finally:
            reservation.release()
            if resp.status < 400:
                self._count_usage(plan, reservation.replica, prompt, usage)
                if self._costs is not None:
                    self._costs.answered(plan, reservation.replica, ttft_s, cached, prompt)
                if self._capture is not None:
                    self._capture.answered(
                        plan,
                        reservation,
                        status=resp.status,
                        ttft_s=ttft_s,
                        cached_tokens=cached,
                        prompt_tokens=prompt,
                    )
            if ttft_s is not None:
                self._learn(reservation, plan, ttft_s, cached)
            with anyio.CancelScope(shield=True):
                await resp.aclose()


class RelayResponse(StreamingResponse):
    """A StreamingResponse that lets go of its upstream however the send ends: also when the
    server never starts iterating the body (a client gone before the first chunk, which
    Starlette notices and cancels the send for), where the relay's own `finally` never runs."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        on_close: Callable[[], Awaitable[None]],
        status_code: int,
        headers: Mapping[str, str],
    ) -> None:
        super().__init__(content, status_code=status_code, headers=headers)
        self._on_close = on_close
        self._finished: list[Callable[[], None]] = []

    def on_finish(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the send has ended, however it ended."""
        self._finished.append(callback)

    async def close_upstream(self) -> None:
        """For a response that will never be sent: release its reservation, close its upstream."""
        await self._on_close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()
            for callback in self._finished:
                callback()


async def _discard(resp: UpstreamResponse | None, reservation: Reservation) -> None:
    """A try that will not be answered: give its slot back and close its upstream connection
    (the engine aborts a request whose connection closed)."""
    reservation.release()
    if resp is not None:
        with anyio.CancelScope(shield=True):
            await resp.aclose()


async def _close_abandoned(response: Response) -> None:
    if isinstance(response, RelayResponse):
        await response.close_upstream()


async def _close(resp: UpstreamResponse, reservation: Reservation) -> None:
    reservation.release()  # both are idempotent: the relay may have done it already
    await resp.aclose()


def _prefill_only(plan: Plan) -> bool:
    limit = plan.body.get("max_tokens", plan.body.get("max_completion_tokens"))
    return isinstance(limit, int) and limit <= 1
