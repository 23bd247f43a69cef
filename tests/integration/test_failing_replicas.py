"""Failing replicas are contained, on real servers: a gateway in front of
simulated replicas and one FaultyReplica (tests/helpers/faulty_replica.py), all uvicorn.

- passive health: a replica answering 500s fast is ejected after health.eject_after_errors in a
  row, although it passes every active check, and the check re-admits it after ejection_s;
- the first-byte timeout: a replica that accepts a streamed request and never answers (or sends
  its headers and never a token) holds it for pools[].first_byte_timeout_s, not the 600 s read
  timeout; the request is answered by the next replica and the silent one is ejected;
- a client that leaves before its answer cancels the upstream request and frees its slot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gateway.http.app import create_app
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from tests.helpers.faulty_replica import FaultyReplica, Mode
from tests.helpers.servers import running_app
from tests.integration.fleet import FAST_COSTS, MODEL, gateway_config

pytestmark = pytest.mark.slow  # `make check` leaves it out: simulated fleets


@dataclass
class Mixed:
    gateway_url: str
    app: Any
    faulty: FaultyReplica
    faulty_name: str  # host:port
    sim_names: list[str]

    def replica(self, name: str) -> Any:
        return self.app.state.gw.registry.replicas[name]

    def metric(self, name: str, **labels: str) -> float:
        value = self.app.state.gw.metrics.registry.get_sample_value(name, labels)
        return float(value or 0.0)


@asynccontextmanager
async def mixed_fleet(
    mode: Mode,
    sims: int,
    *,
    eject_after_errors: int = 3,
    ejection_s: float = 60.0,
    first_byte_timeout_s: float = 60.0,
) -> AsyncIterator[Mixed]:
    """One FaultyReplica (first in the pool) and `sims` simulated replicas behind a gateway."""
    async with AsyncExitStack() as stack:
        faulty = FaultyReplica(mode, MODEL)
        urls = [await stack.enter_async_context(running_app(faulty))]
        for i in range(sims):
            spec = SimReplicaSpec(name=f"sim-{i}", port=0, costs=FAST_COSTS, itl_s=0.001)
            urls.append(await stack.enter_async_context(running_app(create_sim_app(spec))))
        config = gateway_config(
            urls,
            health={
                "interval_s": 0.1,
                "timeout_s": 0.5,
                "fail_after": 1,
                "eject_after_errors": eject_after_errors,
                "ejection_s": ejection_s,
            },
            pools=[
                {
                    "name": "default",
                    "models": [MODEL],
                    "replicas": urls,
                    "first_byte_timeout_s": first_byte_timeout_s,
                    "costs": {"prefill_tokens_per_s": FAST_COSTS.prefill_tokens_per_s},
                }
            ],
        )
        app = create_app(config)
        gateway_url = await stack.enter_async_context(running_app(app))
        names = [u.removeprefix("http://") for u in urls]
        yield Mixed(gateway_url, app, faulty, names[0], names[1:])


def body(i: int, *, stream: bool = False, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"conversation {i}: " + "hello " * 20}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def until(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


# -- passive health: consecutive 5xx eject ---------------------------------------------------


async def test_a_replica_answering_500s_is_ejected_after_the_configured_errors_in_a_row() -> None:
    async with (
        mixed_fleet("error", sims=2, eject_after_errors=3) as m,
        httpx.AsyncClient(base_url=m.gateway_url, timeout=10.0) as h,
    ):
        statuses = []
        for i in range(30):
            r = await h.post("/v1/chat/completions", json=body(i, stream=i % 2 == 0))
            statuses.append(r.status_code)
        # it answered 500 three times, then it was out although its /v1/models kept passing
        assert m.faulty.requests == 3
        assert statuses.count(500) == 3
        assert statuses.count(200) == 27
        faulty = m.replica(m.faulty_name)
        assert not faulty.healthy
        assert (
            m.metric("cachelane_replica_ejections_total", replica=m.faulty_name, reason="5xx") == 1
        )
        # its fast failures taught the cost model nothing (it must not look fast)
        costs = m.app.state.gw.learner.describe()["replicas"]
        assert costs[m.faulty_name]["samples"] == 0
        async with httpx.AsyncClient() as plain:
            metrics = (await plain.get(f"{m.gateway_url}/metrics")).text
        assert (
            f'cachelane_replica_ejections_total{{reason="5xx",replica="{m.faulty_name}"}} 1.0'
            in metrics
        )


async def test_a_replica_ejected_for_its_errors_is_readmitted_by_the_health_check() -> None:
    async with (
        mixed_fleet("error", sims=1, eject_after_errors=2, ejection_s=1.0) as m,
        httpx.AsyncClient(base_url=m.gateway_url, timeout=10.0) as h,
    ):
        faulty = m.replica(m.faulty_name)
        i = 0
        while faulty.healthy:
            await h.post("/v1/chat/completions", json=body(i))
            i += 1
            assert i < 50, "never ejected"
        ejected_at = time.monotonic()
        await asyncio.sleep(0.5)  # five health checks pass meanwhile: too soon to come back
        assert not faulty.healthy
        await until(lambda: faulty.healthy, timeout_s=3.0)
        assert time.monotonic() - ejected_at >= 1.0
        assert faulty.consecutive_errors == 0
        # still failing: ejected again after two more errors
        while faulty.healthy:
            await h.post("/v1/chat/completions", json=body(i))
            i += 1
            assert i < 100, "never ejected again"
        assert (
            m.metric("cachelane_replica_ejections_total", replica=m.faulty_name, reason="5xx") == 2
        )
        assert m.faulty.requests == 4


# -- the first-byte timeout ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["silent", "stalled"])
async def test_a_replica_that_never_answers_is_skipped_after_the_first_byte_timeout(
    mode: Mode,
) -> None:
    async with (
        mixed_fleet(mode, sims=1, eject_after_errors=2, first_byte_timeout_s=0.5) as m,
        httpx.AsyncClient(base_url=m.gateway_url, timeout=10.0) as h,
    ):
        served_by = []
        for i in range(12):
            started = time.monotonic()
            async with h.stream("POST", "/v1/chat/completions", json=body(i, stream=True)) as r:
                assert r.status_code == 200
                text = (await r.aread()).decode()
            assert "[DONE]" in text
            assert time.monotonic() - started < 2.0  # at most one 0.5 s wait on the silent one
            served_by.append(r.headers["x-cachelane-replica"])
        assert set(served_by) == set(m.sim_names)  # every request answered, never by it
        assert m.faulty.requests == 2  # two timeouts in a row eject it
        assert not m.replica(m.faulty_name).healthy
        assert (
            m.metric("cachelane_replica_ejections_total", replica=m.faulty_name, reason="timeout")
            == 1
        )
        assert m.metric("cachelane_upstream_retries_total", replica=m.faulty_name) == 2
        await until(lambda: m.faulty.cancelled == 2)  # the gateway hung up on it both times
        faulty = m.replica(m.faulty_name)
        assert (faulty.in_flight, faulty.awaiting_first_byte, faulty.pending_prefill_tokens) == (
            0,
            0,
            0,
        )


# -- a client that leaves ------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_cancels_the_upstream_request_and_frees_its_slot(
    stream: bool,
) -> None:
    async with mixed_fleet("silent", sims=0) as m:
        async with httpx.AsyncClient(base_url=m.gateway_url, timeout=0.5) as h:
            with pytest.raises(httpx.ReadTimeout):
                await h.post("/v1/chat/completions", json=body(0, stream=stream))
        # the client hung up after 0.5 s: the gateway notices, closes its upstream request
        # (an engine aborts a request whose connection closed) and gives the slot back
        await until(lambda: m.faulty.cancelled == 1, timeout_s=3.0)
        faulty = m.replica(m.faulty_name)
        await until(lambda: faulty.in_flight == 0, timeout_s=1.0)
        assert (faulty.awaiting_first_byte, faulty.pending_prefill_tokens) == (0, 0)
        assert not faulty.joining
        assert m.metric("cachelane_client_gone_total") == 1
        assert m.metric("cachelane_requests_total", endpoint="chat", model=MODEL, status="499") == 1
        assert faulty.healthy  # a client leaving says nothing about the replica
