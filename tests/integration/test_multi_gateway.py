"""Several gateways, one view: two real gateways on one Redis in front of the same replicas."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.http.app import create_app
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import running_app
from tests.integration.fleet import CACHE_VISIBLE_COSTS, MODEL, gateway_config
from tests.integration.test_gateway import SYSTEM, client

pytestmark = pytest.mark.slow  # `make check` leaves it out: several gateways and fleets

TURNS = 6
LOAD_POLLS = 50  # x POLL_S: the gateways scrape engine metrics every 0.1 s
POLL_S = 0.1


@asynccontextmanager
async def two_gateways(
    redis_url: str, *, replicas: int, itl_s: float = 0.001, **overrides: Any
) -> AsyncIterator[tuple[list[str], list[str], list[Any]]]:
    """Sim replicas, and two gateways with the same config on one Redis: (replicas, urls, apps)."""
    async with AsyncExitStack() as stack:
        replica_urls = []
        for i in range(replicas):
            spec = SimReplicaSpec(name=f"sim-{i}", port=0, costs=CACHE_VISIBLE_COSTS, itl_s=itl_s)
            replica_urls.append(await stack.enter_async_context(running_app(create_sim_app(spec))))
        config = gateway_config(
            replica_urls,
            CACHE_VISIBLE_COSTS,
            index={"backend": "redis", "redis_url": redis_url},
            **overrides,
        )
        apps = [create_app(config) for _ in range(2)]
        gateway_urls = [await stack.enter_async_context(running_app(app)) for app in apps]
        yield replica_urls, gateway_urls, apps


async def test_a_conversation_alternating_between_gateways_stays_on_its_replica(
    own_redis: RedisServer,
) -> None:
    async with (
        two_gateways(own_redis.url, replicas=4) as (_, gateway_urls, _apps),
        client(gateway_urls[0]) as a,
        client(gateway_urls[1]) as b,
    ):
        gateways = (a, b)
        conversations: dict[str, list[ChatCompletionMessageParam]] = {
            topic: [{"role": "system", "content": f"Topic: {topic}. {SYSTEM}"}]
            for topic in ("freight", "payroll")
        }
        homes: dict[str, str] = {}
        cached: dict[str, int] = dict.fromkeys(conversations, 0)
        for turn in range(TURNS):
            for k, (topic, messages) in enumerate(conversations.items()):
                messages.append({"role": "user", "content": f"{topic} question {turn}"})
                gateway = gateways[(turn + k) % 2]  # the conversations also swap gateways
                raw = await gateway.chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, max_tokens=4
                )
                completion = raw.parse()
                replica = raw.headers["x-cachelane-replica"]
                usage = completion.usage
                assert usage is not None and usage.prompt_tokens_details is not None
                hit_tokens = usage.prompt_tokens_details.cached_tokens or 0
                if turn == 0:
                    homes[topic] = replica
                else:
                    # The gateway that serves this turn never saw the previous one: only the
                    # shared index can tell it where the conversation's prefix is.
                    assert replica == homes[topic], f"{topic} turn {turn}"
                    assert raw.headers["x-cachelane-reason"] == "hbm_hit"
                    assert hit_tokens > cached[topic] >= 0
                    assert int(raw.headers["x-cachelane-expected-cached-tokens"]) > 0
                cached[topic] = hit_tokens
                content = completion.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": content})
        assert all(hit_tokens > 500 for hit_tokens in cached.values())


async def test_gateway_b_sees_the_load_gateway_a_put_on_a_replica(
    own_redis: RedisServer,
) -> None:
    scrape = {"enabled": True, "interval_s": POLL_S, "timeout_s": 0.5, "stale_after_s": 5.0}
    async with (
        # 0.05 s per token x 400 tokens: the held streams stay open for the whole test.
        two_gateways(own_redis.url, replicas=2, itl_s=0.05, engine_metrics=scrape) as (
            _,
            gateway_urls,
            apps,
        ),
        client(gateway_urls[0]) as a,
        httpx.AsyncClient(base_url=gateway_urls[1]) as b,
        AsyncExitStack() as streams,
    ):
        held: Counter[str] = Counter()
        for i in range(3):
            response = await streams.enter_async_context(
                a.chat.completions.with_streaming_response.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"a long story, number {i}"}],
                    max_tokens=400,
                    stream=True,
                )
            )
            held[response.headers["x-cachelane-replica"]] += 1

        gateway_b = apps[1].state.gw
        probe = {"model": MODEL, "messages": [{"role": "user", "content": "where to?"}]}
        loads: dict[str, Any] = {}
        for _ in range(LOAD_POLLS):
            route = await b.post("/debug/route", json=probe)
            assert route.status_code == 200
            loads = route.json()["load"]
            if all(loads[name]["in_flight"] >= n for name, n in held.items()):
                break
            await asyncio.sleep(POLL_S)
        for name, n in held.items():
            assert gateway_b.registry.replicas[name].in_flight == 0  # B sent none of them
            assert loads[name]["in_flight"] >= n  # ... and sees them through the engine
        idle = set(loads) - set(held)
        assert all(loads[name]["in_flight"] == 0 for name in idle)


async def test_a_new_gateway_starts_with_the_shared_cost_fits(own_redis: RedisServer) -> None:
    async with two_gateways(own_redis.url, replicas=1) as (_, gateway_urls, apps):
        async with client(gateway_urls[0]) as a:
            for i in range(25):
                stream = await a.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"{i} " + "fresh words here. " * 40}],
                    max_tokens=2,
                    stream=True,
                )
                async for _ in stream:
                    pass
        learned = apps[0].state.gw.learner.describe()["replicas"]
        (name,) = learned
        assert learned[name]["samples"] == 25
        await apps[0].state.gw.fit_store.save()
        late = create_app(apps[0].state.gw.config)
        async with running_app(late):
            warm = late.state.gw.learner.describe()["replicas"][name]
        assert warm["samples"] == 25 and warm["source"] == "own fit"
        assert warm["prefill_tokens_per_s"] == learned[name]["prefill_tokens_per_s"]
