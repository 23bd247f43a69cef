"""Every byte has a deadline: a stream whose replica breaks its chunked framing mid-way (a bad
chunk header, then the connection closed: aiohttp 3.14 then waits on it without end, its read
timeout never firing) ends with an error event within the idle deadline
(gateway/serving/deadline.py idle_deadline_s), and is counted. A gateway before a raw replica
(tests/helpers/raw_replica.py), both on loopback, and the real openai client."""

from __future__ import annotations

import asyncio
import json

import httpx

from gateway.http.app import create_app
from gateway.serving.deadline import idle_deadline_s
from tests.helpers.raw_replica import EVENTS, mid_garbage
from tests.helpers.servers import running_app
from tests.integration.fleet import MODEL, gateway_config

CLIENT_TIMEOUT_S = 30.0  # far past the idle deadline (4 s with the pool's defaults)


async def test_a_stream_broken_mid_way_ends_with_an_error_event_in_its_idle_deadline() -> None:
    async with mid_garbage(MODEL) as (url, replica):
        app = create_app(gateway_config([url], health={"eject_after_errors": 0}))
        async with running_app(app) as gateway_url:
            registry = app.state.gw.registry
            for _ in range(100):  # its first health check, within ~5 s
                if all(r.healthy for r in registry.replicas.values()):
                    break
                await asyncio.sleep(0.05)
            pool = next(iter(registry.replicas.values())).pool
            assert idle_deadline_s(pool) < CLIENT_TIMEOUT_S
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
                "stream": True,
            }
            async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as h:
                r = await h.post(f"{gateway_url}/v1/chat/completions", json=body)
            assert r.status_code == 200
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert len(events) == EVENTS + 1
            error = json.loads(events[-1])["error"]
            assert error["code"] in ("upstream_timeout", "upstream_unavailable"), error
            sample = app.state.gw.metrics.registry.get_sample_value
            name = url.removeprefix("http://")
            assert sample("cachelane_upstream_streams_broken_total", {"replica": name}) == 1
            assert replica.requests == 1
