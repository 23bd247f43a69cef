"""Failing replicas cost clients nothing while a healthy one remains, on real servers: a gateway
in front of simulated replicas and FaultyReplicas (tests/helpers/faulty_replica.py), all uvicorn,
and the real openai client with its own retries off (max_retries=0), so every failure shows.

- a replica answering 500, hanging, sending garbage or dropping the connection, streamed or
  whole: each request is retried on the healthy replica before its first byte reaches the
  client; the faulty one is ejected within its first failures (health.eject_after_errors),
  although it passes every /v1/models check;
- a stream that broke after its first byte cannot be retried: it ends with an error event, and
  cachelane_upstream_streams_broken_total counts it;
- re-admission: only after the back-off (health.ejection_s, x ejection_factor per ejection in a
  row) and a passing probe generation; /ready shows the ejection and the next probe;
- the issue's probe: a 500 replica and a hanging one beside one healthy replica, 200 requests,
  half streamed: no client-visible failure;
- a client that leaves before its answer cancels the upstream request and frees its slot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from gateway.fleet.health_checks import PROBE_PROMPT
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
    faulties: list[FaultyReplica]
    faulty_names: list[str]  # host:port, in the order of `faulties`
    sim_names: list[str]

    @property
    def faulty(self) -> FaultyReplica:
        return self.faulties[0]

    @property
    def faulty_name(self) -> str:
        return self.faulty_names[0]

    def replica(self, name: str) -> Any:
        return self.app.state.gw.registry.replicas[name]

    def metric(self, name: str, **labels: str) -> float:
        value = self.app.state.gw.metrics.registry.get_sample_value(name, labels)
        return float(value or 0.0)


@asynccontextmanager
async def mixed_fleet(
    modes: Mode | Sequence[Mode],
    sims: int,
    *,
    eject_after_errors: int = 3,
    ejection_s: float = 60.0,
    ejection_factor: float = 2.0,
    first_byte_timeout_s: float = 60.0,
    min_decode_tokens_per_s: float = 10.0,
) -> AsyncIterator[Mixed]:
    """FaultyReplicas in `modes` (first in the pool) and `sims` simulated replicas behind a
    gateway."""
    async with AsyncExitStack() as stack:
        faulties = [FaultyReplica(m, MODEL) for m in ([modes] if isinstance(modes, str) else modes)]
        urls = [await stack.enter_async_context(running_app(f)) for f in faulties]
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
                "ejection_factor": ejection_factor,
            },
            pools=[
                {
                    "name": "default",
                    "models": [MODEL],
                    "replicas": urls,
                    "first_byte_timeout_s": first_byte_timeout_s,
                    "min_decode_tokens_per_s": min_decode_tokens_per_s,
                    "costs": {"prefill_tokens_per_s": FAST_COSTS.prefill_tokens_per_s},
                }
            ],
        )
        app = create_app(config)
        gateway_url = await stack.enter_async_context(running_app(app))
        names = [u.removeprefix("http://") for u in urls]
        n = len(faulties)
        yield Mixed(gateway_url, app, faulties, names[:n], names[n:])


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


def client_of(m: Mixed) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{m.gateway_url}/v1", api_key="unused", max_retries=0, timeout=20)


async def ask(client: AsyncOpenAI, i: int, *, stream: bool) -> str | None:
    """One chat request as a client makes it; its failure as the client sees it, or None."""
    messages: Any = [{"role": "user", "content": f"conversation {i}: " + "hello " * 20}]
    try:
        if not stream:
            answer = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4
            )
            assert answer.choices
            return None
        chunks = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, stream=True
        )
        seen = 0
        async for _ in chunks:
            seen += 1
        assert seen > 0
        return None
    except openai.APIError as err:
        return f"{type(err).__name__}: {err}"


EJECTED_FOR = {
    "error": "5xx",
    "silent": "timeout",
    "stalled": "timeout",
    "garbage": "disconnect",
    "drop": "disconnect",
}


# -- no failed request while a healthy replica remains ----------------------------------------


@pytest.mark.parametrize("mode", list(EJECTED_FOR))
async def test_a_failing_replica_costs_the_client_nothing_and_is_ejected_within_its_failures(
    mode: Mode,
) -> None:
    # deadlines far above a healthy answer's time here (~0.2 s on a loaded 2-core machine)
    async with mixed_fleet(mode, sims=1, eject_after_errors=2, first_byte_timeout_s=1.0) as m:
        faulty = m.replica(m.faulty_name)
        client = client_of(m)
        failures, i = [], 0
        while faulty.healthy:  # alternately whole and streamed, until it is out
            failures += [f for f in [await ask(client, i, stream=i % 2 == 1)] if f]
            i += 1
            assert i < 60, "never ejected"
        for j in range(i, i + 10):  # and after: only the healthy one serves
            failures += [f for f in [await ask(client, j, stream=j % 2 == 1)] if f]
        await client.close()
        # ejected by its failures, although its /v1/models kept passing: all of one tenant's
        # (auth is open), they made it a suspect, and the probe generation that it then failed
        # took it out (requests sent meanwhile went to it too, and were retried as well)
        sent = [b for b in m.faulty.bodies if b.get("prompt") != PROBE_PROMPT]
        assert len(sent) >= 2
        assert len(sent) + 1 == m.faulty.requests  # and the one probe that ejected it
        reason = EJECTED_FOR[mode]
        ejections = "cachelane_replica_ejections_total"
        assert m.metric(ejections, replica=m.faulty_name, reason=reason) == 1
        broken = m.metric("cachelane_upstream_streams_broken_total", replica=m.faulty_name)
        streamed_to_it = sum(1 for b in m.faulty.bodies if b.get("stream"))
        if mode == "drop":  # a stream that began cannot be retried: the client sees it, counted
            assert len(failures) == broken == streamed_to_it
        else:
            assert failures == []
            assert broken == 0
        if mode in ("silent", "stalled"):  # the gateway hung up on it every time
            await until(lambda: m.faulty.cancelled == m.faulty.requests)
        retried = m.metric("cachelane_upstream_retries_total", replica=m.faulty_name)
        assert retried == len(sent) - broken  # every failure before the first byte went elsewhere
        # its fast failures taught the cost model nothing (it must not look fast)
        costs = m.app.state.gw.learner.describe()["replicas"]
        assert costs[m.faulty_name]["samples"] == 0
        assert (faulty.in_flight, faulty.awaiting_first_byte) == (0, 0)


# -- re-admission: back-off, then a probe generation -------------------------------------------


async def test_an_ejected_replica_comes_back_only_after_its_backoff_and_a_passing_probe() -> None:
    async with (
        mixed_fleet("error", sims=1, eject_after_errors=2, ejection_s=0.5) as m,
        httpx.AsyncClient(base_url=m.gateway_url, timeout=10.0) as h,
    ):
        faulty = m.replica(m.faulty_name)
        i = 0
        while faulty.healthy:
            r = await h.post("/v1/chat/completions", json=body(i))
            assert r.status_code == 200  # retried on the healthy replica
            i += 1
            assert i < 50, "never ejected"
        assert faulty.ejection is not None
        ejected_at = faulty.ejection.since_s  # time.monotonic()
        sent = m.faulty.requests  # before the back-off can end: the probe comes after
        asked_s = time.monotonic()
        ready = (await h.get("/ready")).json()["replicas"][m.faulty_name]
        answered_s = time.monotonic()
        assert not ready["healthy"]
        assert ready["ejected"]["reason"] == "5xx"
        assert ready["ejected"]["ejections_in_a_row"] == 1
        # what was left of the 0.5 s back-off while /ready answered (0 once it was over: a
        # loaded machine may take that long), to the 3 decimals it is given in
        left_after = max(0.0, 0.5 - (answered_s - ejected_at)) - 0.001
        left_before = max(0.0, 0.5 - (asked_s - ejected_at)) + 0.001
        assert left_after <= ready["ejected"]["next_probe_in_s"] <= left_before
        # its back-off over, the probe (one token) fails: out for twice as long
        await until(lambda: faulty.ejection is not None and faulty.ejection.count == 2)
        assert not faulty.healthy
        assert m.faulty.requests == sent + 1
        probe = m.faulty.bodies[-1]
        assert (probe["path"], probe["max_tokens"]) == ("/v1/completions", 1)
        readmissions = "cachelane_replica_readmissions_total"
        assert m.metric(readmissions, replica=m.faulty_name, reason="5xx") == 0
        probes = "cachelane_replica_probes_total"
        # the probe that ejected the suspect (one tenant's errors: auth is open), and this one
        assert m.metric(probes, replica=m.faulty_name, outcome="failed") == 2
        ready = (await h.get("/ready")).json()["replicas"][m.faulty_name]
        assert ready["ejected"]["ejections_in_a_row"] == 2
        # it recovers: the next probe passes and full traffic returns
        m.faulty.mode = "ok"
        await until(lambda: faulty.healthy, timeout_s=5.0)
        assert time.monotonic() - ejected_at >= 0.5 + 1.0  # both back-offs sat out
        assert m.faulty.bodies[-1]["max_tokens"] == 1  # a probe let it in, not a request
        assert m.metric(readmissions, replica=m.faulty_name, reason="5xx") == 1
        assert m.metric(probes, replica=m.faulty_name, outcome="passed") == 1
        ready = (await h.get("/ready")).json()["replicas"][m.faulty_name]
        assert ready["healthy"] and ready["ejected"] is None


# -- the probe: two faulty replicas beside one healthy one -----------------------------


REQUESTS = 200
CONCURRENCY = 8


async def test_a_500_replica_and_a_hanging_one_cost_none_of_200_requests() -> None:
    # a healthy answer takes ~0.2 s here, up to ~0.5 s under load (8 at once, 2 loaded cores):
    # a 2 s first byte (2.4 s for a whole answer of 4 tokens) cuts only the hanging replica
    async with mixed_fleet(
        ["error", "silent"], sims=1, eject_after_errors=3, ejection_s=2.0, first_byte_timeout_s=2.0
    ) as m:
        client = client_of(m)
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(i: int) -> str | None:
            async with gate:
                return await ask(client, i, stream=i % 2 == 1)

        started = time.monotonic()
        outcomes = await asyncio.gather(*(one(i) for i in range(REQUESTS)))
        took_s = time.monotonic() - started
        await client.close()
        failures = [o for o in outcomes if o is not None]
        error_name, silent_name = m.faulty_names
        # a suspect is ejected by its probe generation, and the hanging one's probe takes its
        # one-token deadline (2.4 s) to fail: it may still be under way when the requests end
        await until(lambda: not any(m.replica(n).healthy for n in m.faulty_names), 10.0)
        numbers: dict[str, Any] = {
            "failures": len(failures),
            "took_s": round(took_s, 2),
            "sent_to_500": m.faulties[0].requests,
            "sent_to_hanging": m.faulties[1].requests,
            "ejections_5xx": m.metric(
                "cachelane_replica_ejections_total", replica=error_name, reason="5xx"
            ),
            "ejections_timeout": m.metric(
                "cachelane_replica_ejections_total", replica=silent_name, reason="timeout"
            ),
            "retries": sum(
                m.metric("cachelane_upstream_retries_total", replica=n) for n in m.faulty_names
            ),
            "failed_probes": [
                sum(1 for b in f.bodies if b["path"] == "/v1/completions") for f in m.faulties
            ],
            "ejections_in_a_row": [
                e.count if (e := m.replica(n).ejection) is not None else 0 for n in m.faulty_names
            ],
        }
        print(f"failing replicas probe: {numbers}")
        assert failures == []
        for name in m.faulty_names:
            assert not m.replica(name).healthy
            assert m.replica(name).in_flight == 0
        assert numbers["ejections_5xx"] >= 1
        assert numbers["ejections_timeout"] >= 1
        # ejected by their failures: all of one tenant's (auth is open), so the threshold made
        # each a suspect, and its probe generation took it out; requests sent meanwhile went
        # there too, each retried (none failed, above). Probes are not client requests.
        for faulty in m.faulties:
            requests = [b for b in faulty.bodies if b["path"] == "/v1/chat/completions"]
            assert len(requests) >= 3


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
