"""A replica's error answer reaches the client as the gateway's own OpenAI error, never as the
replica sent it: a gateway before one FaultyReplica (tests/helpers/faulty_replica.py), both
uvicorn on loopback, and the real openai client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from gateway.http.app import create_app
from gateway.http.errors import MAX_ENGINE_MESSAGE_CHARS
from tests.helpers.faulty_replica import FaultyReplica, Mode
from tests.helpers.servers import running_app
from tests.integration.fleet import MODEL, gateway_config


@asynccontextmanager
async def before(mode: Mode) -> AsyncIterator[tuple[AsyncOpenAI, Any]]:
    """The openai client of a gateway whose one replica answers in `mode`, and the gateway."""
    async with AsyncExitStack() as stack:
        replica = await stack.enter_async_context(running_app(FaultyReplica(mode, MODEL)))
        # the replica's own failures must not take it out here: every answer is the one tested
        app = create_app(gateway_config([replica], health={"eject_after_errors": 0}))
        url = await stack.enter_async_context(running_app(app))
        for _ in range(100):  # its first health check, within ~5 s
            if all(r.healthy for r in app.state.gw.registry.replicas.values()):
                break
            await asyncio.sleep(0.05)
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        stack.push_async_callback(client.close)
        yield client, app


async def refusal(client: AsyncOpenAI, *, stream: bool) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as err:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=stream
        )
    return err.value


def errors(app: Any, code: str) -> float:
    sample = app.state.gw.metrics.registry.get_sample_value
    return float(sample("cachelane_errors_total", {"code": code}) or 0.0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("mode", "status", "code", "kind"),
    [
        ("unauthorized", 502, "upstream_auth_failed", "server_error"),
        ("error", 500, "upstream_error", "server_error"),
        ("refuse", 400, "invalid_request", "invalid_request_error"),
    ],
)
async def test_a_replicas_error_body_becomes_the_gateways_own_error(
    mode: Mode, status: int, code: str, kind: str, stream: bool
) -> None:
    async with before(mode) as (client, app):
        err = await refusal(client, stream=stream)
        assert err.status_code == status
        body = err.response.json()
        assert set(body) == {"error"}
        assert set(body["error"]) == {"message", "type", "param", "code"}  # OpenAI's envelope
        assert (body["error"]["code"], body["error"]["type"]) == (code, kind)
        assert "Unauthorized" not in err.response.text  # the replica's own body
        assert "engine failure" not in err.response.text  # a 5xx's text is the engine's
        assert errors(app, code) == 1
        if mode == "unauthorized":  # not the client's key: the gateway's, and retry later
            assert err.response.headers["retry-after"] == "1"
        if mode == "refuse":  # the engine's reason is kept, bounded, on one line
            message = body["error"]["message"]
            assert message.startswith("This model's maximum context length is 8 tokens.")
            assert "\n" not in message and len(message) <= MAX_ENGINE_MESSAGE_CHARS + 10
            assert body["error"]["param"] == "messages"
