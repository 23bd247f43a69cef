"""The one place where failures become OpenAI error envelopes.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

Handlers raise ApiError (a replica's failures are mapped by upstream_error below); the app's
exception handlers render every one of them the same way and count it in
cachelane_errors_total{code}.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from gateway.serving.upstream import UpstreamError, UpstreamTimeout


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


def bad_request(
    message: str, *, code: str = "invalid_request", param: str | None = None
) -> ApiError:
    return ApiError(400, message, code=code, param=param)


def no_replica(model: str, retry_after_s: int = 1) -> ApiError:
    return ApiError(
        503,
        f"no healthy replica can serve model {model!r} right now",
        code="no_healthy_replica",
        type="service_unavailable",
        headers={"retry-after": str(retry_after_s)},
    )


def upstream_error(replica: str, err: UpstreamError) -> ApiError:
    """Map a failure talking to a replica (gateway/serving/upstream.py) to a public error."""
    if isinstance(err, UpstreamTimeout):
        return ApiError(
            504, f"replica {replica} timed out", code="upstream_timeout", type="upstream_error"
        )
    return ApiError(
        502,
        f"replica {replica} failed: {type(err).__name__}",
        code="upstream_unavailable",
        type="upstream_error",
    )
