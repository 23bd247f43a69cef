"""A replica that fails mid-answer, on real servers (uvicorn, httpx, the openai client): the
client gets OpenAI's error type (`server_error`) with the gateway's code, a 502 says when to
retry, and a stream that broke after its 200 head is logged with the error's status and code.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
from starlette.types import Receive, Scope, Send

from gateway.http.app import create_app
from tests.helpers.faulty_replica import is_http
from tests.helpers.servers import running_app
from tests.integration.fleet import MODEL, gateway_config

FIRST_CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'


class BreaksMidAnswer:
    """Passes the health check (lists its model); answers 200 and one chunk, then its
    connection drops (an engine killed while it generates)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not await is_http(scope, receive, send):
            return
        if scope["method"] == "GET":
            body = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            await _answer(send, "application/json", body.encode(), more=False)
            return
        request = b""
        while True:
            message = await receive()
            request += message.get("body", b"")
            if not message.get("more_body", False):
                break
        stream = json.loads(request).get("stream") is True
        if stream:
            await _answer(send, "text/event-stream", FIRST_CHUNK, more=True)
        else:
            await _answer(send, "application/json", b'{"id": "x", "choi', more=True)
        raise RuntimeError("the engine died mid-answer")  # uvicorn drops the connection


async def _answer(send: Send, content_type: str, body: bytes, *, more: bool) -> None:
    headers = [(b"content-type", content_type.encode())]
    if not more:
        headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": more})


@asynccontextmanager
async def breaking_fleet() -> AsyncIterator[tuple[str, Any]]:
    async with running_app(BreaksMidAnswer()) as replica_url:
        app = create_app(gateway_config([replica_url]))
        async with running_app(app) as gateway_url:
            replica = app.state.gw.registry.replicas[replica_url.removeprefix("http://")]
            for _ in range(250):  # bounded: the first health check admits it
                if replica.healthy:
                    break
                await asyncio.sleep(0.02)
            assert replica.healthy
            yield gateway_url, app


def chat(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "stream": stream,
    }


async def test_a_stream_broken_mid_way_ends_with_a_server_error_logged_as_502(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="cachelane.access")
    async with breaking_fleet() as (url, app), httpx.AsyncClient(base_url=url, timeout=10) as h:
        async with h.stream("POST", "/v1/chat/completions", json=chat(True)) as resp:
            assert resp.status_code == 200  # the head went out with the first chunk
            body = b"".join([chunk async for chunk in resp.aiter_bytes()])
    assert body.startswith(FIRST_CHUNK)
    last = body.removeprefix(FIRST_CHUNK).decode()
    error = json.loads(last.removeprefix("data: "))["error"]
    assert (error["type"], error["code"]) == ("server_error", "upstream_unavailable")
    lines = [r.access for r in caplog.records if r.name == "cachelane.access"]  # type: ignore[attr-defined]
    chats = [a for a in lines if a["path"] == "/v1/chat/completions"]
    assert [(a["status"], a["code"]) for a in chats] == [(502, "upstream_unavailable")]
    # and the requests counter says the same as the access line, not the 200 of the head
    registry = app.state.gw.metrics.registry
    counted = {
        status: registry.get_sample_value(
            "cachelane_requests_total", {"endpoint": "chat", "model": MODEL, "status": status}
        )
        for status in ("200", "502")
    }
    assert counted == {"200": None, "502": 1.0}


async def test_a_whole_answer_broken_mid_way_is_a_502_with_retry_after() -> None:
    async with breaking_fleet() as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=10) as h:
            r = await h.post("/v1/chat/completions", json=chat(False))
        assert r.status_code == 502
        assert r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "upstream_unavailable")
        # the official client reads it as a server error it may retry
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(**chat(False))
        assert caught.value.status_code == 502
        assert caught.value.type == "server_error"
        await client.close()
