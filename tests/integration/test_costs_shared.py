"""Two gateways on one real Redis share their cost accounting; `cachelane report --redis` (a
subprocess) merges them into one fleet's account."""

from __future__ import annotations

import json

import pytest

from tests.helpers.redis_server import RedisServer
from tests.integration.test_costs import cli
from tests.integration.test_gateway import chat, client
from tests.integration.test_multi_gateway import two_gateways

pytestmark = pytest.mark.slow  # `make check` leaves it out: several gateways and fleets

MODEL = "sim-llama-8b"


async def test_report_through_redis_merges_the_gateways(own_redis: RedisServer) -> None:
    async with two_gateways(own_redis.url, replicas=2) as (_, gateway_urls, apps):
        sent = {0: 3, 1: 5}
        for i, count in sent.items():
            async with client(gateway_urls[i]) as c:
                for n in range(count):
                    stream = await c.chat.completions.create(
                        model=MODEL, messages=chat(f"question {n}"), max_tokens=2, stream=True
                    )
                    async for _ in stream:
                        pass
        for app in apps:  # what each does every COST_SHARE_INTERVAL_S, now
            await app.state.gw.cost_store.save()
        merged = json.loads(await cli("report", "--redis", own_redis.url, "--json"))
        (row,) = merged["rows"]
        assert row["sums"]["requests"] == sum(sent.values())
        assert row["sums"]["timed_requests"] == sum(sent.values())
        text = await cli("report", "--redis", own_redis.url, "--window", "1h")
        assert "Where the cost of offloading landed" in text and "cache hits avoided" in text
        empty = await cli("report", "--redis", own_redis.url.rsplit("/", 1)[0] + "/5", check=False)
        assert "no gateway has published its accounting recently" in empty
