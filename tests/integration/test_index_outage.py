"""Redis goes away mid-run: the gateway keeps serving on its local view, says so, and recovers.

The test owns its redis-server (never the session's), stops it, and starts it again on the same
port; the gateway is not restarted.
"""

from __future__ import annotations

import asyncio
import re

import httpx
from openai import AsyncOpenAI
from redis.asyncio import Redis

from gateway.index.resilient import ResilientIndex
from tests.helpers.redis_server import RedisServer
from tests.integration.fleet import CACHE_VISIBLE_COSTS, MODEL, fleet
from tests.integration.test_gateway import chat, client

RECOVERY_POLLS = 100  # x POLL_S: the gateway probes Redis once a second while degraded
POLL_S = 0.1


def metric(text: str, name: str) -> float:
    total = 0.0
    for match in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE):
        total += float(match.group(1))
    return total


async def ask(c: AsyncOpenAI, question: str) -> tuple[str, str]:
    raw = await c.chat.completions.with_raw_response.create(
        model=MODEL, messages=chat(question), max_tokens=3
    )
    assert raw.parse().choices[0].message.content
    return raw.headers["x-cachelane-replica"], raw.headers["x-cachelane-reason"]


async def test_gateway_serves_through_a_redis_outage_and_recovers(
    own_redis: RedisServer,
) -> None:
    index_config = {"backend": "redis", "redis_url": own_redis.url}
    async with (
        fleet(3, costs=CACHE_VISIBLE_COSTS, index=index_config) as f,
        client(f.gateway_url) as c,
        httpx.AsyncClient(base_url=f.gateway_url) as h,
    ):
        index = f.gw.index
        assert isinstance(index, ResilientIndex)
        home, _ = await ask(c, "before the outage")
        ready = (await h.get("/ready")).json()
        assert ready["index"] == {"backend": "redis", "ok": True, "degraded_since": None}

        own_redis.stop()
        # One at a time (no load to spread), the local view still sends the shared prompt to the
        # replica that holds it; concurrent or not, no request fails.
        for i in range(5):
            assert await ask(c, f"outage, one by one {i}") == (home, "hbm_hit")
        concurrent = await asyncio.gather(*(ask(c, f"outage, together {i}") for i in range(20)))
        holders = {home} | {replica for replica, _ in concurrent}
        assert index.degraded
        ready_resp = await h.get("/ready")
        assert ready_resp.status_code == 200
        ready = ready_resp.json()
        assert ready["ready"] is True
        assert ready["index"]["backend"] == "redis"
        assert ready["index"]["ok"] is False
        assert isinstance(ready["index"]["degraded_since"], float)
        metrics = (await h.get("/metrics")).text
        assert metric(metrics, "cachelane_index_degraded") == 1.0
        assert metric(metrics, "cachelane_index_errors_total") >= 1

        own_redis.start()  # the same port: the gateway's URL is unchanged
        for i in range(RECOVERY_POLLS):
            await ask(c, f"after the outage {i}")
            if not index.degraded:
                break
            await asyncio.sleep(POLL_S)
        assert not index.degraded
        ready = (await h.get("/ready")).json()
        assert ready["index"] == {"backend": "redis", "ok": True, "degraded_since": None}
        assert metric((await h.get("/metrics")).text, "cachelane_index_degraded") == 0.0

        # The restarted Redis started empty; the writes made during the outage were replayed into
        # it, so the shared index (read again now) sends the shared prompt home.
        admin = Redis.from_url(own_redis.url)
        try:
            assert await admin.dbsize() > 0
        finally:
            await admin.aclose()
        replica, reason = await ask(c, "after recovery")
        assert reason == "hbm_hit" and replica in holders
