"""A replica that fails the way real ones do, for integration tests on real servers.

It passes the active health check (GET /v1/models lists its model), so only what its answers to
completions look like can take it out of routing. Its `mode` says how it answers a completion:

- "error": 500 at once, with an OpenAI error body (an engine whose every request fails fast);
- "silent": accepts the request and never answers (a wedged process);
- "stalled": sends 200 and the event-stream headers, then nothing (what vLLM does when its
  engine hangs: the headers go out before the first token).

`requests` counts the completions it was sent; `cancelled` those whose connection the caller
closed while it was holding them (the gateway cancelling the upstream request).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from starlette.types import Receive, Scope, Send

Mode = Literal["error", "silent", "stalled"]


@dataclass
class FaultyReplica:
    mode: Mode
    model: str
    requests: int = 0
    cancelled: int = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if scope["method"] == "GET" and scope["path"] == "/v1/models":
            data = {"object": "list", "data": [{"id": self.model, "object": "model"}]}
            await _json(send, 200, data)
            return
        while (await receive()).get("more_body", False):
            pass  # read the request body to its end
        self.requests += 1
        if self.mode == "error":
            error = {"message": "engine failure", "type": "server_error", "code": None}
            await _json(send, 500, {"error": error})
            return
        if self.mode == "stalled":
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"", "more_body": True})
        message = await receive()  # blocks until the caller goes away (or the server stops)
        if message["type"] == "http.disconnect":
            self.cancelled += 1


async def _json(send: Send, status: int, data: Any) -> None:
    body = json.dumps(data).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
