"""The one place where failures become OpenAI error envelopes.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

Handlers raise ApiError (a replica's failures are mapped by upstream_error below); the app's
exception handlers render every one of them the same way and count it in
cachelane_errors_total{code}.

`type` is one of OpenAI's: `invalid_request_error` (4xx caused by the request, the default),
`server_error` (5xx: the gateway or its fleet could not answer now), and for 429 the limit that
refused (`requests`, `tokens`), as OpenAI sends them; `code` is the gateway's own, specific one
(`no_healthy_replica`, `upstream_timeout`, `overloaded`, ...), which clients and the
cachelane_errors_total metric tell apart.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from gateway.serving.upstream import UpstreamError, UpstreamTimeout

SERVER_ERROR = "server_error"  # OpenAI's type for a 5xx (its 500s and 503 "overloaded")
UPSTREAM_RETRY_AFTER_S = 1  # a retry after a replica failed goes to a healthy one at once


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type = type
        self.param = param
        self.headers = headers or {}

    def envelope(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.envelope(), status_code=self.status, headers=self.headers)


def retry_later(
    status: int, message: str, *, code: str, retry_after_s: int, param: str | None = None
) -> ApiError:
    """A failure of the gateway or its fleet, not of the request (OpenAI's server_error type),
    that the client may retry after `retry_after_s` seconds (the Retry-After header)."""
    return ApiError(
        status,
        message,
        code=code,
        type=SERVER_ERROR,
        param=param,
        headers={"retry-after": str(retry_after_s)},
    )


def bad_request(
    message: str, *, code: str = "invalid_request", param: str | None = None
) -> ApiError:
    return ApiError(400, message, code=code, param=param)


def no_replica(model: str, retry_after_s: int = 1) -> ApiError:
    return retry_later(
        503,
        f"no healthy replica can serve model {model!r} right now",
        code="no_healthy_replica",
        retry_after_s=retry_after_s,
    )


def upstream_error(replica: str, err: UpstreamError) -> ApiError:
    """Map a failure talking to a replica (gateway/serving/upstream.py) to a public error: 504 when
    it timed out; else 502 with Retry-After, since the replica that failed is ejected or counted an
    error (gateway/serving/proxy.py) and a retry goes to another, or to it once it is back."""
    if isinstance(err, UpstreamTimeout):
        return ApiError(
            504, f"replica {replica} timed out", code="upstream_timeout", type=SERVER_ERROR
        )
    return retry_later(
        502,
        f"replica {replica} failed: {type(err).__name__}",
        code="upstream_unavailable",
        retry_after_s=UPSTREAM_RETRY_AFTER_S,
    )
