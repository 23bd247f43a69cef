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

import json
from typing import Any

from fastapi.responses import JSONResponse

from gateway.serving.upstream import UpstreamError, UpstreamTimeout

SERVER_ERROR = "server_error"  # OpenAI's type for a 5xx (its 500s and 503 "overloaded")
UPSTREAM_RETRY_AFTER_S = 1  # a retry after a replica failed goes to a healthy one at once
# An engine's message on a request it refused is kept to this many characters: vLLM's longest
# (a context-length refusal naming both lengths) is ~300
MAX_ENGINE_MESSAGE_CHARS = 1000
# A replica's refusal of a request, by its status: the gateway's code for it
REFUSAL_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    422: "invalid_request",
}


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


def _engine_message(content: bytes) -> tuple[str | None, str | None]:
    """(message, param) of an engine's error body, if it is OpenAI's envelope or vLLM's flat
    form (`{"object": "error", "message": ..., "param": ...}`); control characters escaped."""
    try:
        body = json.loads(content, parse_int=str, parse_float=str)
    except ValueError:
        return None, None
    error = body.get("error") if isinstance(body, dict) else None
    found = error if isinstance(error, dict) else body if isinstance(body, dict) else {}
    message, param = found.get("message"), found.get("param")
    if not isinstance(message, str) or not message:
        return None, None
    shown = json.dumps(message[:MAX_ENGINE_MESSAGE_CHARS], ensure_ascii=False)[1:-1]
    return shown, param if isinstance(param, str) and len(param) <= 256 else None


def replica_answer_error(replica: str, status: int, content: bytes) -> ApiError:
    """The gateway's own error for a replica's error answer (`status` >= 400), never the
    replica's body: a 401 or 403 means the replica refused the gateway's credentials (a fault
    of the deployment, 502 `upstream_auth_failed`), a 429 that it is overloaded (503
    `upstream_overloaded`, Retry-After), any other 4xx that it refused the request (its status,
    the engine's message when it gave one in OpenAI's or vLLM's form), a 5xx that it failed (its
    status, `upstream_error`, no engine text: it may carry the engine's internals)."""
    if status in (401, 403):
        return retry_later(
            502,
            f"replica {replica} refused the gateway's credentials",
            code="upstream_auth_failed",
            retry_after_s=UPSTREAM_RETRY_AFTER_S,
        )
    if status == 429:
        return retry_later(
            503,
            f"replica {replica} is overloaded",
            code="upstream_overloaded",
            retry_after_s=UPSTREAM_RETRY_AFTER_S,
        )
    if status >= 500:
        return ApiError(
            status, f"replica {replica} failed ({status})", code="upstream_error", type=SERVER_ERROR
        )
    message, param = _engine_message(content)
    return ApiError(
        status,
        message or f"replica {replica} refused the request ({status})",
        code=REFUSAL_CODES.get(status, "upstream_refused"),
        param=param,
    )
