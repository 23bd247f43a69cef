"""Send a planned request to its replica and relay the answer, streaming byte for byte.

Retries: when the chosen replica cannot be reached before the first byte (refused, reset, stale
keep-alive), the next replica in the decision's ranking is tried, at most `retries` times; an
unreachable replica is ejected at once and re-admitted by the health checker. Once the replica
has answered, its status and body pass through as they are (4xx included).

Every path releases the load it reserved: `Reservation.release()` is synchronous and idempotent
and runs in `finally`, so success, client disconnect (the relay task is cancelled) and upstream
failure all give the slot back.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse

from gateway import calibration
from gateway.errors import ApiError, no_replica, upstream_error
from gateway.metrics import Metrics
from gateway.planner import Plan, Planner
from gateway.registry import Registry, Replica, Reservation

log = logging.getLogger("cachelane.proxy")

_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError)
_EJECTING = (httpx.ConnectError, httpx.ConnectTimeout)
_PASSED_HEADERS = ("content-type",)
NAMESPACE_HEADER = "x-cachelane-namespace"  # the simulator hashes blocks in this namespace
REMOTE_WRITE_HEADER = "x-cachelane-remote-write"  # "0": do not write this KV to the remote tier

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def decision_headers(plan: Plan, replica: Replica) -> dict[str, str]:
    score = plan.decision.score(replica.name)
    headers = {
        "x-cachelane-replica": replica.name,
        "x-cachelane-reason": plan.decision.reason.value,
        "x-cachelane-est-ttft-ms": f"{score.estimate.ttft_s * 1000:.1f}",
        "x-cachelane-expected-cached-tokens": str(score.expected_cached_tokens),
        "x-cachelane-tenant-class": plan.tenant.tenant_class.value,
    }
    if plan.fallback is not None:
        headers["x-cachelane-fallback"] = plan.fallback.value
    if plan.admission is not None:
        headers[REMOTE_WRITE_HEADER] = "1" if plan.admission.write else "0"
    return headers


def upstream_request_headers(plan: Plan) -> dict[str, str]:
    headers = {"content-type": "application/json", NAMESPACE_HEADER: plan.namespace}
    if plan.admission is not None:
        headers[REMOTE_WRITE_HEADER] = "1" if plan.admission.write else "0"
    return headers


def upstream_body(plan: Plan, replica: Replica, raw_body: bytes) -> bytes:
    """The client's bytes as they came, unless the pool isolates tenants with vLLM's cache_salt."""
    if not replica.pool.cache_salt:
        return raw_body
    return json.dumps({**plan.body, "cache_salt": plan.cache_salt}).encode()


def _upstream_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: resp.headers[k] for k in _PASSED_HEADERS if k in resp.headers}


class Proxy:
    def __init__(
        self,
        clients: Mapping[str, httpx.AsyncClient],
        registry: Registry,
        planner: Planner,
        metrics: Metrics,
        *,
        retries: int,
    ) -> None:
        self._clients = clients  # one connection pool per replica, by replica name
        self._registry = registry
        self._planner = planner
        self._metrics = metrics
        self._retries = retries

    async def forward(self, endpoint: str, raw_body: bytes, plan: Plan) -> Response:
        path = ENDPOINT_PATHS[endpoint]
        last_error: Exception | None = None
        attempts = 0
        for name in plan.decision.ranking:
            replica = plan.replicas[name]
            if not replica.healthy:
                continue
            if attempts > self._retries:
                break
            attempts += 1
            reservation = self._reserve(plan, replica)
            await self._planner.record_sent(plan, replica)
            client = self._clients[replica.name]
            request = client.build_request(
                "POST",
                replica.url + path,
                content=upstream_body(plan, replica, raw_body),
                headers=upstream_request_headers(plan),
            )
            try:
                resp = await client.send(request, stream=True)
            except _RETRYABLE as err:
                reservation.release()
                await self._registry.mark_failed(
                    replica, repr(err), eject=isinstance(err, _EJECTING)
                )
                self._metrics.retries.labels(replica.name).inc()
                log.warning("replica %s unreachable (%r), trying the next one", replica.name, err)
                last_error = err
                continue
            except BaseException as err:
                reservation.release()
                if isinstance(err, httpx.HTTPError):
                    raise upstream_error(replica.name, err) from err
                raise
            headers = _upstream_headers(resp) | decision_headers(plan, replica)
            if plan.stream and resp.status_code < 400:
                headers["cache-control"] = "no-cache"
                headers["x-accel-buffering"] = "no"
                return StreamingResponse(
                    self._relay(resp, reservation, plan),
                    status_code=resp.status_code,
                    headers=headers,
                )
            try:
                content = await resp.aread()
            except httpx.HTTPError as err:
                raise upstream_error(replica.name, err) from err
            finally:
                self._observe(reservation, plan, calibrate=_prefill_only(plan))
                reservation.release()
                await resp.aclose()
            return Response(content, status_code=resp.status_code, headers=headers)
        if last_error is not None:
            raise upstream_error(plan.decision.replica, last_error)
        raise no_replica(plan.model)

    def _reserve(self, plan: Plan, replica: Replica) -> Reservation:
        score = plan.decision.score(replica.name)
        prefill = score.overlap.prompt_tokens - score.expected_cached_tokens
        swaps = 1 if score.overlap.cpu_tokens else 0
        return self._registry.reserve(replica, prefill_tokens=prefill, swaps=swaps)

    def _observe(self, reservation: Reservation, plan: Plan, *, calibrate: bool) -> None:
        ttft_s = reservation.first_byte()
        replica = reservation.replica
        self._metrics.ttft_seconds.labels(replica.name).observe(ttft_s)
        tenant = plan.tenant
        self._metrics.tenant_ttft_seconds.labels(tenant.name, tenant.tenant_class.value).observe(
            ttft_s
        )
        if calibrate:
            score = plan.decision.score(replica.name)
            calibration.observe(
                replica, score.raw_ttft_s, score.estimate.ttft_s, ttft_s, self._metrics
            )

    async def _relay(
        self, resp: httpx.Response, reservation: Reservation, plan: Plan
    ) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                if reservation.first_byte_s is None:
                    self._observe(reservation, plan, calibrate=True)
                yield chunk
        except httpx.HTTPError as err:
            api_error: ApiError = upstream_error(reservation.replica.name, err)
            self._metrics.errors.labels(api_error.code).inc()
            log.warning("stream from %s broke: %r", reservation.replica.name, err)
            yield f"data: {json.dumps(api_error.envelope())}\n\n".encode()
        finally:
            reservation.release()
            with anyio.CancelScope(shield=True):
                await resp.aclose()


def _prefill_only(plan: Plan) -> bool:
    limit = plan.body.get("max_tokens", plan.body.get("max_completion_tokens"))
    return isinstance(limit, int) and limit <= 1
