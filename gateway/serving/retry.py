"""What a failed try on a replica means for the request: the next replica is tried (TryNext),
or the failure is the answer. Nothing has reached the client before a replica's first byte is
relayed, so a try that fails before it may be repeated elsewhere (gateway/serving/proxy.py)."""

from __future__ import annotations

import json
import logging

import orjson
from fastapi.responses import Response

from gateway.fleet.registry import Registry
from gateway.fleet.replica import Replica
from gateway.http.errors import upstream_error
from gateway.serving.upstream import (
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
)
from gateway.telemetry.metrics import Metrics

log = logging.getLogger("cachelane.proxy")

_RETRYABLE = (UpstreamConnectError, UpstreamDisconnected)  # before the first byte
SSE_FIELDS = (b"data:", b":", b"event:", b"id:", b"retry:")  # an event stream's lines begin so


def is_json(data: bytes) -> bool:
    """Whether `data` is JSON (RFC 8259), whatever its numbers: orjson first (fast), then the
    standard library with numbers left as text, since orjson refuses integers past 64 bits and
    an answer may echo a request's (a field the gateway passes on, in the engine's own answer)."""
    try:
        orjson.loads(data)
        return True
    except orjson.JSONDecodeError:
        pass
    try:
        json.loads(data, parse_int=str, parse_float=str)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return False
    return True


def garbled(resp: UpstreamResponse, start: bytes | None) -> str | None:
    """Why an accepted answer cannot be what it says it is (then the next replica is tried:
    nothing was sent on yet): a JSON answer that does not parse, an event stream whose first
    bytes are no event field (WHATWG HTML, "Server-sent events": the field names). A JSON answer
    whose numbers are beyond a parser's range is JSON: what a request made a replica say is not
    the replica's failure."""
    if resp.status >= 400 or not start:
        return None
    content_type = (resp.content_type or "").lower()
    if "text/event-stream" in content_type and not start.lstrip().startswith(SSE_FIELDS):
        return f"not an event stream: {start[:40]!r}"
    if "json" in content_type and "event-stream" not in content_type and not is_json(start):
        return f"not JSON: {start[:40]!r}"
    return None


class TryNext(Exception):
    """This try got no answer in a way the next replica may mend; `answer`: the 5xx answer it
    got (answered if no other replica answers); `free`: it costs none of the request's retries
    (its replica went down while it waited: nothing was asked of the fleet twice)."""

    def __init__(
        self, error: UpstreamError, answer: Response | None = None, *, free: bool = False
    ) -> None:
        super().__init__(repr(error))
        self.error = error
        self.answer = answer
        self.free = free


async def failed_try(
    registry: Registry,
    metrics: Metrics,
    replica: Replica,
    err: BaseException,
    timeout_s: float | None,
    *,
    tenant: str,
) -> BaseException:
    """What a failed try of `tenant`'s request raises: TryNext when the next replica may answer
    (this one is marked down or counted an error), an ApiError for an upstream failure no retry
    mends, else the error itself."""
    if isinstance(err, TimeoutError) and not replica.healthy:  # marked down while it waited
        metrics.retries.labels(replica.name).inc()
        log.warning("replica %s went down before it answered, trying the next one", replica.name)
        went = UpstreamTimeout(f"replica {replica.name} went down before it answered")
        return TryNext(went, free=True)
    if isinstance(err, (TimeoutError, UpstreamTimeout)):  # the deadline, or the read timeout
        silent = (
            err
            if isinstance(err, UpstreamTimeout)
            else UpstreamTimeout(f"no first byte in {timeout_s or 0:.3g} s")
        )
        # 504 if no other replica answers
        await registry.errored(replica, repr(silent), reason="timeout", tenant=tenant)
        metrics.retries.labels(replica.name).inc()
        log.warning(
            "replica %s did not answer in time (%s), trying the next one", replica.name, silent
        )
        return TryNext(silent)
    if isinstance(err, _RETRYABLE):
        if isinstance(err, UpstreamConnectError):
            await registry.unreachable(replica, repr(err))
        else:  # reset, closed, not HTTP: an error in a row, as a 5xx answer is
            await registry.errored(replica, repr(err), reason="disconnect", tenant=tenant)
        metrics.retries.labels(replica.name).inc()
        log.warning("replica %s unreachable (%r), trying the next one", replica.name, err)
        return TryNext(err)
    if isinstance(err, UpstreamError):
        return upstream_error(replica.name, err)
    return err
