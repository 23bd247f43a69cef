"""A stuck replica is left by what the estimate expected, and a replica marked down lets go of the
requests waiting on it, on real servers: a gateway before FaultyReplicas
(tests/helpers/faulty_replica.py) and simulated replicas, all uvicorn on loopback, and the real
openai client with a 15 s timeout (Envoy's default route timeout) and its own retries off.

The pools keep the default hard cap, first_byte_timeout_s 60 s: only the request's own deadline
(4x its estimated TTFT + 3 s: gateway/serving/deadline.py) or the replica going down can get a
request off a stuck replica before the client gives up.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import openai
from openai import AsyncOpenAI

from gateway.http.app import create_app
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from tests.helpers.faulty_replica import FaultyReplica, Mode
from tests.helpers.servers import running_app
from tests.integration.fleet import FAST_COSTS, MODEL, gateway_config

CLIENT_TIMEOUT_S = 15.0  # Envoy's default route timeout
CONCURRENCY = 8


@dataclass
class Fleet:
    url: str
    app: Any
    faulties: list[FaultyReplica]
    faulty_names: list[str]


@asynccontextmanager
async def stuck_fleet(modes: Sequence[Mode], sims: int, **health: Any) -> AsyncIterator[Fleet]:
    async with AsyncExitStack() as stack:
        faulties = [FaultyReplica(mode, MODEL) for mode in modes]
        urls = [await stack.enter_async_context(running_app(f)) for f in faulties]
        for i in range(sims):
            spec = SimReplicaSpec(name=f"sim-{i}", port=0, costs=FAST_COSTS, itl_s=0.001)
            urls.append(await stack.enter_async_context(running_app(create_sim_app(spec))))
        checks = {"interval_s": 0.2, "timeout_s": 0.5, "fail_after": 1} | health
        app = create_app(gateway_config(urls, health=checks))
        url = await stack.enter_async_context(running_app(app))
        registry = app.state.gw.registry
        for _ in range(100):  # every replica's first health check, within ~5 s
            if all(r.healthy for r in registry.replicas.values()):
                break
            await asyncio.sleep(0.05)
        names = [u.removeprefix("http://") for u in urls[: len(faulties)]]
        yield Fleet(url, app, faulties, names)


async def lost(client: AsyncOpenAI, i: int) -> str | None:
    """One request, half of them streamed: its failure as the client sees it, or None."""
    messages: Any = [{"role": "user", "content": f"conversation {i}: " + "hello " * 20}]
    try:
        if i % 2:
            seen = 0
            stream = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, stream=True
            )
            async for _ in stream:
                seen += 1
            return None if seen else "an empty stream"
        answer = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        return None if answer.choices else "no choices"
    except openai.APIError as err:
        return f"{type(err).__name__}: {err}"


async def run(url: str, n: int) -> list[str]:
    """`n` requests, CONCURRENCY at a time; the failures."""
    client = AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
    )
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> str | None:
        async with gate:
            return await lost(client, i)

    try:
        outcomes = await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()
    return [o for o in outcomes if o is not None]


async def test_a_500_and_a_hanging_replica_lose_no_request_of_clients_timing_out_at_15_s() -> None:
    async with stuck_fleet(["error", "silent"], sims=1) as f:
        failures = await run(f.url, 60)
        assert failures == []
        silent = f.faulties[1]
        assert silent.requests >= 1  # it was tried, and left before the client's timeout


async def test_requests_waiting_on_a_replica_marked_down_are_retried_at_once() -> None:
    """A replica that stops answering everything (a paused process) is marked down by its health
    check within a second; the requests waiting on it for their first byte go to the next
    replica then, not at their own deadline, and count no error against it."""
    async with stuck_fleet(["ok"], sims=1) as f:
        faulty = f.faulties[0]
        replica = f.app.state.gw.registry.replicas[f.faulty_names[0]]
        faulty.mode = "paused"
        client = AsyncOpenAI(
            base_url=f"{f.url}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
        )
        try:
            asked = [asyncio.create_task(lost(client, i)) for i in range(16)]
            for _ in range(100):  # its health check fails within ~1 s
                if not replica.healthy:
                    break
                await asyncio.sleep(0.05)
            # let go at once, before their own deadline (ESTIMATE_MARGIN_S: 3 s after sending)
            for _ in range(15):
                if not replica.awaiting_first_byte:
                    break
                await asyncio.sleep(0.1)
            assert replica.awaiting_first_byte == 0
            failures = [o for o in await asyncio.gather(*asked) if o is not None]
        finally:
            await client.close()
        assert failures == []
        assert not replica.healthy
        assert replica.consecutive_errors == 0  # let go when it went down, not timed out
        waited = faulty.requests
        assert waited >= 1  # some were sent to it before its health check failed
        retried = f.app.state.gw.metrics.registry.get_sample_value(
            "cachelane_upstream_retries_total", {"replica": f.faulty_names[0]}
        )
        assert retried == waited
