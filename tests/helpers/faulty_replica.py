"""A replica that fails the way real ones do, for integration tests on real servers.

It passes the active health check (GET /v1/models lists its model), so only what its answers to
completions look like can take it out of routing. Its `mode` says how it answers a completion:

- "error": 500 at once, with an OpenAI error body (an engine whose every request fails fast);
- "silent": accepts the request and never answers (a wedged process);
- "stalled": sends 200 and the event-stream headers, then nothing (what vLLM does when its
  engine hangs: the headers go out before the first token);
- "garbage": 200 with bytes that are neither JSON nor an event stream (a broken proxy or
  engine in front of it);
- "drop": begins its answer (a streamed one with its first event, a whole one with part of
  its body) and closes the connection (a process killed mid-answer);
- "paused": every request hangs, its model list too (a paused process: its health check fails);
- "unauthorized": 401 with vLLM's body for a wrong `--api-key` (`{"error": "Unauthorized"}`);
- "refuse": 400 with vLLM's flat error form, its message long and with a line break in it;
- "ok": answers as an engine does, whole or streamed (a replica that has recovered: `mode`
  may be changed while it runs).

`requests` counts the completions it was sent (`bodies`: their bodies, with their "path");
`cancelled` those whose connection the caller closed while it was holding them (the gateway
cancelling the upstream request).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.types import Receive, Scope, Send

Mode = Literal[
    "error", "silent", "stalled", "garbage", "drop", "paused", "unauthorized", "refuse", "ok"
]
REFUSAL = "This model's maximum context length is 8 tokens.\nforged: line " + "x" * 3000
GARBAGE = b"\x00\xffnot an answer\r\n\x1b[2J"
CHUNK = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "x"}}]}
EVENT = b"data: " + json.dumps(CHUNK).encode() + b"\n\n"


async def is_http(scope: Scope, receive: Receive, send: Send) -> bool:
    """Whether `scope` is an HTTP request for the app to answer; a lifespan is answered here, as
    an app's with nothing to set up or close."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return False
    return bool(scope["type"] == "http")


@dataclass
class FaultyReplica:
    mode: Mode
    model: str
    requests: int = 0
    cancelled: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)  # of the completions, in order

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not await is_http(scope, receive, send):
            return
        if self.mode == "paused":
            self.requests += scope["path"] != "/v1/models"
            await receive()  # the request's body
            if (await receive())["type"] == "http.disconnect":  # until the caller goes away
                self.cancelled += 1
            return
        if scope["method"] == "GET" and scope["path"] == "/v1/models":
            data = {"object": "list", "data": [{"id": self.model, "object": "model"}]}
            await _json(send, 200, data)
            return
        raw = b""
        while True:  # read the request body to its end
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.requests += 1
        self.bodies.append({"path": scope["path"], **json.loads(raw or b"{}")})
        stream = bool(self.bodies[-1].get("stream"))
        if self.mode == "error":
            error = {"message": "engine failure", "type": "server_error", "code": None}
            await _json(send, 500, {"error": error})
            return
        if self.mode == "unauthorized":
            await _json(send, 401, {"error": "Unauthorized"})
            return
        if self.mode == "refuse":
            refusal = {"object": "error", "message": REFUSAL, "type": "BadRequestError"}
            await _json(send, 400, refusal | {"param": "messages", "code": 400})
            return
        if self.mode in ("garbage", "drop", "ok"):
            await _answer(send, self.mode, stream, scope["path"])
            return
        if self.mode == "stalled":
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"", "more_body": True})
        message = await receive()  # blocks until the caller goes away (or the server stops)
        if message["type"] == "http.disconnect":
            self.cancelled += 1


async def _answer(send: Send, mode: Mode, stream: bool, path: str) -> None:
    content_type = b"text/event-stream" if stream else b"application/json"
    if mode == "garbage":
        headers = [(b"content-type", content_type)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": GARBAGE})
        return
    if mode == "drop":  # a declared length it never reaches: the connection closes short
        headers = [(b"content-type", content_type), (b"content-length", b"100000")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        part = EVENT if stream else b'{"id": "cmpl-1", "object": '
        await send({"type": "http.response.body", "body": part, "more_body": True})
        return  # uvicorn closes a connection whose answer the app left unfinished
    chat = path.endswith("/chat/completions")
    if not stream:
        choice = {"index": 0, "finish_reason": "length"}
        choice |= {"message": {"role": "assistant", "content": "x"}} if chat else {"text": "x"}
        kind = "chat.completion" if chat else "text_completion"
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        await _json(send, 200, {"id": "x", "object": kind, "choices": [choice], "usage": usage})
        return
    headers = [(b"content-type", content_type)]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": EVENT, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _json(send: Send, status: int, data: Any) -> None:
    body = json.dumps(data).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
