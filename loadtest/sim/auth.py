"""A simulated replica that requires a key, as vLLM started with `--api-key` does.

vLLM checks `Authorization: Bearer <key>` on every path under /v1 (its AuthenticationMiddleware in
vllm/entrypoints/openai/api_server.py) and leaves /health and /metrics open; an authenticating proxy
in front of an engine often guards /metrics too. The simulator guards every path but /health, the
stricter of the two, so a test sees the gateway send the key on each kind of call it makes
(requests, health checks, scrapes, warms). A missing or wrong key is a 401 in OpenAI's envelope.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health"})


class RequireKey:
    def __init__(self, app: ASGIApp, *, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        error = {
            "message": "invalid or missing API key",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
        await JSONResponse({"error": error}, status_code=401)(scope, receive, send)
