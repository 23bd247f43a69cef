"""Send a planned request to its replica and relay the answer, streaming byte for byte.

Retries: nothing has reached the client before the replica's first byte, so a try that fails
before it is tried on the next replica of the decision's ranking (each at most once, at most
`retries` more; a try whose replica was marked down meanwhile costs none): a replica that cannot be
reached, that answers 5xx, that does not begin its answer in time (gateway/serving/deadline.py) or
whose answer is garbled (gateway/serving/retry.py). Then the last 5xx is answered, else 502 or 504.
A 4xx is answered at once (the request is at fault), except an engine's refusal of the class's
`priority`, sent again without it (gateway/serving/refused_priority.py); a replica's error becomes
the gateway's own (gateway/http/errors.py replica_answer_error). Once a streamed answer has begun, a
failure ends it with an error event. Passive health (Registry.answered, .errored, .unreachable):
failures in a row, or one refused connection, eject a replica until its back-off is over and a
probe generation passes (gateway/fleet/outliers.py), as Envoy's outlier detection; one tenant's
failures alone only make it a suspect that a probe judges.

A client that leaves before its answer began (polled through `client_gone`) has its upstream
request cancelled: the connection is closed, which makes vLLM abort the request.

Every try holds its reservation in a Lease (gateway/serving/lease.py) for its lifetime: success,
client disconnect, a retry and upstream failure all give the slot back exactly once; a streamed
answer's response takes the lease over until its last byte. After-answer work is the
settlement's observers' (gateway/serving/settlement.py), once per answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import orjson
from fastapi.responses import Response

from gateway.config import UpstreamConfig
from gateway.fleet.registry import Registry
from gateway.fleet.replica import Replica, Reservation
from gateway.http.disconnect import ClientGone, while_client_waits
from gateway.http.errors import ApiError, no_replica, replica_answer_error, upstream_error
from gateway.serving.deadline import (
    chunks_within,
    first_byte_deadline_s,
    idle_deadline_s,
    output_limit_tokens,
)
from gateway.serving.lease import Lease
from gateway.serving.planner import Plan
from gateway.serving.refused_priority import without_refused_priority
from gateway.serving.relay_response import OpenStream, RelayResponse, close_shielded
from gateway.serving.relay_time import RelayTime
from gateway.serving.retry import TryNext, failed_try, garbled
from gateway.serving.settlement import Settled, Settlement, finish_shielded, whole_answer
from gateway.serving.upstream import (
    Upstream,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
)
from gateway.serving.usage import StreamReader, ask_for_usage
from gateway.telemetry import logs, tracing
from gateway.telemetry.metrics import Metrics
from routing.cost import Estimate
from routing.decide import Score

log = logging.getLogger("cachelane.proxy")

NAMESPACE_HEADER = "x-cachelane-namespace"  # the simulator hashes blocks in this namespace
REMOTE_WRITE_HEADER = "x-cachelane-remote-write"  # "0": do not write this KV to the remote tier


_USAGE = {"include_usage": True}
ENDPOINT_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "responses": "/v1/responses",
}


def decision_headers(
    plan: Plan, replica: Replica, sent_s: float, relay_s: float = 0.0
) -> dict[str, str]:
    """The decision, and the TTFT the client can expect: the time the request spent in the
    gateway before it was sent at `sent_s` (measured), the replica's estimate, then `relay_s`,
    the gateway's recent time to hand a first chunk on (gateway/serving/relay_time.py)."""
    score = plan.decision.score(replica.name)
    gateway_s = plan.in_gateway_s(sent_s)
    est_s = gateway_s + score.estimate.ttft_s + relay_s
    headers = {
        "x-cachelane-replica": replica.name,
        "x-cachelane-reason": plan.decision.reason.value,
        "x-cachelane-est-ttft-ms": f"{est_s * 1000:.1f}",
        "x-cachelane-est-terms-ms": estimate_terms(score.estimate, gateway_s, relay_s),
        "x-cachelane-expected-cached-tokens": str(score.expected_cached_tokens),
        "x-cachelane-expected-tiers": expected_tiers(score),
        "x-cachelane-tenant-class": plan.tenant.tenant_class.value,
    }
    if plan.fallback is not None:
        headers["x-cachelane-fallback"] = plan.fallback.value
    if plan.admission is not None:
        headers[REMOTE_WRITE_HEADER] = "1" if plan.admission.write else "0"
    return headers


def expected_tiers(score: Score) -> str:
    """Where the estimate expects the reused tokens, e.g. "hbm=1200,cpu=640,remote=0" (remote:
    those it fetches; the sum is x-cachelane-expected-cached-tokens)."""
    o, fetched = score.overlap, score.estimate.remote_fetch
    return f"hbm={o.hbm_tokens},cpu={o.cpu_tokens},remote={o.remote_tokens if fetched else 0}"


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
    or schedules by the class's priority, or the stream must be asked for its usage (the
    client did not ask: gateway/serving/usage.py)."""
    extra: dict[str, Any] = {}
    if ask_for_usage(plan.endpoint, plan.body):
        options = plan.body.get("stream_options")
        extra["stream_options"] = {**(options if isinstance(options, dict) else {}), **_USAGE}
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
        metrics: Metrics,
        settlement: Settlement,
        config: UpstreamConfig,
    ) -> None:
        self._upstream = upstream
        self._registry = registry
        self._metrics = metrics
        self._settlement = settlement  # what happens after an answer (settlement.py)
        self._retries = config.retries
        self._read_timeout_s = config.read_timeout_s  # a whole answer's, with no output bound
        self._relay_time = RelayTime()

    async def forward(
        self,
        endpoint: str,
        raw_body: bytes,
        plan: Plan,
        *,
        client_gone: Callable[[], Awaitable[bool]] | None = None,
        reserved: Lease | None = None,
    ) -> Response:
        """Send a planned request to its replica and return the replica's answer.

        `endpoint`: "chat" or "completions" (the upstream path); `raw_body`: the client's bytes,
        forwarded unchanged unless the replica's pool adds fields (vLLM's cache_salt, the
        class's priority: upstream_body); `plan`: Planner.plan's output; `client_gone`: asked
        every gateway.http.disconnect.DISCONNECT_POLL_S until the answer is ready (Starlette's
        `Request.is_disconnected`): once the client has left, the upstream request is
        cancelled, its reservation released, and ApiError 499 raised; `reserved`: the first
        choice's lease made with the decision (reserve_first): forward() owns it from here,
        sends the request on it, and releases it on every path (also when it is never tried).

        Replicas are tried in the decision's ranking, skipping unhealthy ones, at most
        `retries` more after the first (the module docstring says when); each try holds a
        reservation on its replica; a replica that accepts the request (status < 400) is told
        to the settlement (the index records the prompt there: Planner.record_sent).

        Returns a RelayResponse for a streamed request the replica accepted (it holds the
        reservation until the stream ends, however it ends, and then settles it), otherwise the
        whole body as a Response; the replica's status passes through (4xx and 5xx included).
        Raises ApiError: 502 or 504 (upstream_error) when every replica tried was unreachable or
        silent, or when one failed or timed out in a way a retry cannot mend (after the request
        may have reached it); 503 (no_replica) when no replica in the ranking was healthy; 499
        when the client left first. Any other exception propagates after the reservation is
        released.
        """
        try:
            if client_gone is None:
                return await self._forward(endpoint, raw_body, plan, reserved)
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
        finally:
            if reserved is not None:
                reserved.release()  # the first choice, if no try took it

    async def _forward(
        self, endpoint: str, raw_body: bytes, plan: Plan, reserved: Lease | None
    ) -> Response:
        path = ENDPOINT_PATHS[endpoint]
        last_error: UpstreamError | None = None
        last_answer: Response | None = None
        attempts = 0
        for name in plan.decision.ranking:
            replica = plan.replicas[name]
            mine = reserved is not None and reserved.holds(replica)
            if not replica.healthy and not mine:
                continue
            if attempts > self._retries:
                break
            attempts += 1
            if mine and reserved is not None:
                lease = reserved.hand_over()
                lease.reservation.started_s = time.perf_counter()  # sent now: the TTFT counts
            else:
                lease = Lease(self._reserve(plan, replica))
            with lease:
                try:
                    return await self._try(path, raw_body, plan, lease)
                except TryNext as failed:
                    last_error = failed.error
                    last_answer = failed.answer or last_answer
                    attempts -= failed.free
        if last_answer is not None:
            return last_answer
        if last_error is not None:
            raise upstream_error(plan.decision.replica, last_error)
        raise no_replica(plan.model)

    async def _try(self, path: str, raw_body: bytes, plan: Plan, lease: Lease) -> Response:
        """One try on the lease's replica: its answer, or TryNext when the next may answer."""
        replica = lease.reservation.replica
        body = upstream_body(plan, replica, raw_body)
        headers = replica.request_headers(upstream_request_headers(plan))
        # gateway/serving/deadline.py; a whole answer with no output bound: the read timeout
        timeout_s = (
            first_byte_deadline_s(
                replica.pool,
                stream=plan.stream,
                endpoint=plan.endpoint,
                body=plan.body,
                card=replica.model_cards.get(plan.model),
                estimate_s=plan.decision.score(replica.name).estimate.ttft_s,
            )
            or self._read_timeout_s
        )
        resp: UpstreamResponse | None = None
        chunks: AsyncIterator[bytes] | None = None
        first: bytes | None = None
        accepting: asyncio.Future[None] | None = None  # the acceptance, still running
        content = b""  # a whole answer's, or a 5xx answer's: read within the deadline
        try:
            # ends at once when the replica is marked down meanwhile (Registry._eject)
            async with asyncio.timeout(timeout_s) as deadline:
                with replica.awaiting(deadline):
                    resp = await self._upstream.post(replica.url + path, body, headers)
                    if resp.status == 400 and plan.engine_priority(replica) is not None:
                        again = partial(upstream_body, plan, replica, raw_body)  # without it
                        resp = await without_refused_priority(
                            self._upstream, resp, replica, path, again, headers
                        )
                    # a whole answer's TTFT
                    head_s = time.perf_counter() - lease.reservation.started_s
                    if resp.status < 400 and plan.stream:  # accepted while the replica prefills
                        chunks = resp.chunks()
                        first, accepting = await self._settlement.accepted_while_reading(
                            plan, replica, chunks
                        )
                    else:  # nothing is sent on before the whole answer is in: a retry stays safe
                        if resp.status < 400:  # only a replica that took it holds its prompt
                            await self._settlement.accepted(plan, replica)
                        content = await resp.read()
                    why = garbled(resp, first if chunks is not None else content)
                    if why is not None:
                        raise UpstreamDisconnected(why)
        except BaseException as err:
            lease.release()  # a try that will not be answered gives its slot back at once
            await finish_shielded(accepting)
            await close_shielded(resp)  # the engine aborts a request whose connection closed
            failure = await failed_try(
                self._registry, self._metrics, replica, err, timeout_s, tenant=plan.tenant.name
            )
            if failure is err:
                raise
            raise failure from err
        try:
            if chunks is None:  # a stream that began is judged when it ends (_relay)
                await self._registry.answered(replica, resp.status, tenant=plan.tenant.name)
        except BaseException:  # cancelled here (a client gone): the lease's `with` releases
            await close_shielded(resp)
            raise
        if resp.status >= 500:
            reservation = lease.reservation
            lease.release()
            await close_shielded(resp)
            raise self._answered_error(plan, reservation, resp, content)
        if chunks is not None:
            return self._stream(plan, lease, resp, chunks, first, accepting)
        return await self._whole(plan, lease, resp, content, head_s)

    def _answered_error(
        self, plan: Plan, reservation: Reservation, resp: UpstreamResponse, content: bytes
    ) -> TryNext:
        """A 5xx answer, read whole: the next replica is tried; this answer passes through if
        no other one answers."""
        replica = reservation.replica
        self._metrics.retries.labels(replica.name).inc()
        log.warning("replica %s answered %d, trying the next one", replica.name, resp.status)
        answer = self._error_answer(plan, reservation, resp.status, content)
        return TryNext(UpstreamError(f"answered {resp.status}"), answer)

    def _error_answer(
        self, plan: Plan, reservation: Reservation, status: int, content: bytes
    ) -> Response:
        """A replica's error answer as the gateway's own (errors.py replica_answer_error)."""
        replica = reservation.replica
        error = replica_answer_error(replica.name, status, content)
        error.headers = error.headers | decision_headers(plan, replica, reservation.started_s)
        return _CountedError(error, self._metrics)

    def _stream(
        self,
        plan: Plan,
        lease: Lease,
        resp: UpstreamResponse,
        chunks: AsyncIterator[bytes],
        first: bytes | None,
        accepting: asyncio.Future[None] | None,
    ) -> Response:
        """The streamed answer's response, which takes the lease over until the stream ends,
        and with it the first byte's work (OpenStream.first_sent)."""
        reservation = lease.reservation
        relay_s = self._relay_time.seconds
        headers = _upstream_headers(resp) | decision_headers(
            plan, reservation.replica, reservation.started_s, relay_s
        )
        headers["cache-control"] = "no-cache"
        headers["x-accel-buffering"] = "no"
        reader = StreamReader(strip_usage=ask_for_usage(plan.endpoint, plan.body))
        settled = Settled(plan, reservation, resp.status, streamed=True, reader=reader)
        if first is not None:  # its prefill is done: what it loaded is in HBM now
            settled.ttft_s = reservation.first_byte()
        answer = OpenStream(lease.hand_over(), resp, settled, self._settlement, accepting)
        first_byte_s = reservation.first_byte_s
        if first is not None and first_byte_s is not None:
            answer.start_decoding(first, first_byte_s, output_limit_tokens(plan.body, None))
        return RelayResponse(
            self._relay(chunks, first, answer),
            stream=answer,
            status_code=resp.status,
            headers=headers,
        )

    async def _whole(
        self, plan: Plan, lease: Lease, resp: UpstreamResponse, content: bytes, head_s: float
    ) -> Response:
        """The whole answer, read by the try (`head_s` after sending, its head came): released
        and settled on every path."""
        reservation = lease.reservation
        replica = reservation.replica
        try:
            # after the whole generation, unless prefill-only
            ttft_s = reservation.first_byte(step_end=False)
            lease.release()
        finally:
            await resp.aclose()  # safe under cancellation (UpstreamResponse's contract)
        self._settlement.settle(
            whole_answer(plan, reservation, resp.status, ttft_s, content, head_s)
        )
        if resp.status >= 400:
            return self._error_answer(plan, reservation, resp.status, content)
        headers = _upstream_headers(resp) | decision_headers(plan, replica, reservation.started_s)
        return Response(content, status_code=resp.status, headers=headers)

    def reserve_first(self, plan: Plan) -> Lease | None:
        """Reserve the decision's first healthy choice now (None: none is healthy). Called in
        the decision's own step of the event loop: a request decided in the same step (a burst
        read at once after a stall) then sees this one's load instead of the same idle replica.
        The caller hands the lease to forward(), or releases it."""
        for name in plan.decision.ranking:
            replica = plan.replicas[name]
            if replica.healthy:
                return Lease(self._reserve(plan, replica))
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

    async def _relay(
        self, chunks: AsyncIterator[bytes], first: bytes | None, answer: OpenStream
    ) -> AsyncIterator[bytes]:
        """Relay the stream byte for byte, from its first chunk (read before the response was
        returned, within the first-byte timeout), its events read on the side (the usage, the
        last token's time: gateway/serving/usage.py); the answer is settled when it ends, however it
        ends. A replica that fails mid-way ends the stream with an error event, and the access
        line says the error's status and code, not the 200 sent at the start."""
        settled = answer.settled
        reader = settled.reader
        tenant = settled.plan.tenant.name
        try:
            if first is not None:
                out = reader.relay(first, time.perf_counter())
                if out:
                    yield out
                first_byte_s = settled.reservation.first_byte_s
                if first_byte_s is not None:  # handed on: the way back is measured
                    self._relay_time.observe(time.perf_counter() - first_byte_s)
                await answer.first_sent()
                idle_s = idle_deadline_s(settled.replica.pool)
                async for chunk in chunks_within(chunks, idle_s):
                    now_s = time.perf_counter()
                    answer.read_tokens(chunk, now_s)  # the replica's engine steps
                    out = reader.relay(chunk, now_s)
                    if out:
                        yield out
                rest = reader.rest()
                if rest:
                    yield rest
            await self._registry.answered(settled.replica, settled.status, tenant=tenant)
        except UpstreamError as err:
            name = settled.replica.name
            api_error: ApiError = upstream_error(name, err)
            self._metrics.errors.labels(api_error.code).inc()
            self._metrics.streams_broken.labels(name).inc()
            reason = "timeout" if isinstance(err, UpstreamTimeout) else "disconnect"
            await self._registry.errored(settled.replica, repr(err), reason=reason, tenant=tenant)
            answer.broke(api_error.status)
            logs.note_stream_failed(api_error.status, api_error.code)
            log.warning("stream from %s broke: %r", name, err)
            yield f"data: {json.dumps(api_error.envelope())}\n\n".encode()
        finally:
            await answer.finish()


class _CountedError(Response):
    """An ApiError's answer, counted in cachelane_errors_total{code} once it is sent."""

    def __init__(self, error: ApiError, metrics: Metrics) -> None:
        rendered = error.response()
        super().__init__(rendered.body, status_code=error.status, headers=dict(rendered.headers))
        self._error = error
        self._metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self._metrics.errors.labels(self._error.code).inc()
        await super().__call__(scope, receive, send)


async def _close_abandoned(response: Response) -> None:
    if isinstance(response, RelayResponse):
        await response.close_upstream()
