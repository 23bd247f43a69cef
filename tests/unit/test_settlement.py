"""A request is settled once and its reservation released once, on every way out: success
(streamed and whole), a client gone before and after the first byte, an upstream error, a retry
onto another replica, a request held by flow control whose client leaves.

gateway/serving/proxy.py against the in-process fake replicas of tests/unit/test_proxy.py; a
listener on the registry counts each reservation's releases, a recording observer each answer's
settlements. The flow-control exits run through the real gateway.serving.handling.hold and the
handler's own `_hold`."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, cast

import httpx
import pytest
from fastapi import Request

from gateway.config import UpstreamConfig, parse_config
from gateway.fleet.registry import Registry
from gateway.fleet.replica import Joining, Reservation
from gateway.http.disconnect import ClientGone, while_client_waits
from gateway.http.errors import ApiError
from gateway.http.serve import _hold
from gateway.serving.handling import dispatch_now
from gateway.serving.lease import Lease
from gateway.serving.proxy import Proxy
from gateway.serving.relay_response import RelayResponse
from gateway.serving.settlement import Observer, Settled, Settlement, observers
from gateway.serving.upstream import UpstreamDisconnected
from gateway.state import Gateway
from gateway.wiring import build_gateway
from routing.types import TenantClass
from tests.unit.test_proxy import (
    ASGI_23,
    ASKS_USAGE,
    MODEL,
    SSE,
    STANDARD,
    URLS,
    Answer,
    FakeFleet,
    Sent,
    Setup,
    delayed,
    disconnect_once,
    gone_at_poll,
    json_answer,
    metric,
    raw_chat,
    read_all,
    refuses,
    setup,
    stalls,
    stream_of,
)


class Releases:
    """A registry load listener (gateway/fleet/registry.py LoadListener) that counts each
    reservation's releases."""

    def __init__(self) -> None:
        self.made: list[Reservation] = []
        self.count: Counter[int] = Counter()

    def reserved(self, reservation: Reservation, joining: Joining) -> None:
        self.made.append(reservation)

    def first_byte(self, reservation: Reservation) -> None:
        return None

    def released(self, reservation: Reservation) -> None:
        self.count[id(reservation)] += 1

    def times(self) -> list[int]:
        """Releases of each reservation made, in the order they were made."""
        return [self.count[id(r)] for r in self.made]


class Recorder(Observer):
    def __init__(self) -> None:
        self.settled: list[Settled] = []

    def on_settled(self, settled: Settled) -> None:
        self.settled.append(settled)


def watch(registry: Registry) -> Releases:
    releases = Releases()
    registry.load_listener = releases
    return releases


def recorded(s: Setup) -> Recorder:
    """Settle `s.proxy`'s answers through the usual observers and a recorder."""
    recorder = Recorder()
    chain = [*observers(s.planner, s.metrics, s.learner).observers, recorder]
    s.proxy = Proxy(s.fleet, s.registry, s.metrics, Settlement(chain), UpstreamConfig(retries=2))
    return recorder


def assert_idle(registry: Registry) -> None:
    for r in registry.replicas.values():
        assert (r.in_flight, r.pending_prefill_tokens, r.awaiting_first_byte) == (0, 0, 0), r.name
        assert not r.joining, r.name


# -- the lease -----------------------------------------------------------------------------------


async def test_a_lease_handed_over_leaves_the_giver_empty_and_releases_once() -> None:
    s = await setup()
    releases = watch(s.registry)
    replica = next(iter(s.registry.replicas.values()))
    giver = Lease(s.registry.reserve(replica, prefill_tokens=10, swaps=0))
    with giver:
        taker = giver.hand_over()
        assert not giver.held and taker.holds(replica)
    assert replica.in_flight == 1  # the giver's exit let go of nothing
    with taker:
        pass
    taker.release()  # a second release finds nothing to give back
    assert releases.times() == [1]
    assert_idle(s.registry)
    with pytest.raises(RuntimeError):
        _ = taker.reservation


async def test_a_lease_is_released_when_its_block_is_cancelled() -> None:
    s = await setup()
    releases = watch(s.registry)
    replica = next(iter(s.registry.replicas.values()))

    async def holds() -> None:
        with Lease(s.registry.reserve(replica, prefill_tokens=10, swaps=0)):
            await asyncio.Event().wait()

    task = asyncio.ensure_future(holds())
    await asyncio.sleep(0)
    assert replica.in_flight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert releases.times() == [1]
    assert_idle(s.registry)


# -- every exit of a forwarded request -----------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_success_is_settled_once_and_released_once(stream: bool) -> None:
    s = await setup()
    releases, recorder = watch(s.registry), recorded(s)
    _, response = await s.forward(raw_chat(stream=stream, **(ASKS_USAGE if stream else {})))
    if stream:
        assert b"".join(SSE) == await read_all(response)
        assert isinstance(response, RelayResponse)
        await response.close_upstream()  # the response's own close after the relay's: no-op
    assert releases.times() == [1]
    assert [(x.streamed, x.answered, x.status) for x in recorder.settled] == [(stream, True, 200)]
    s.assert_all_released()


async def test_a_client_gone_before_the_answer_is_released_once_and_not_settled() -> None:
    s = await setup()
    releases, recorder = watch(s.registry), recorded(s)
    for name in s.registry.replicas:
        s.fleet.behaviour[name] = stalls  # its first byte never comes
    plan = await s.plan(json.loads(raw_chat(stream=True)))
    reserved = s.proxy.reserve_first(plan)

    async def gone() -> bool:
        return bool(s.fleet.sent)  # it leaves once the request reached its replica

    with pytest.raises(ApiError) as caught:
        await s.proxy.forward(
            "chat", raw_chat(stream=True), plan, client_gone=gone, reserved=reserved
        )
    assert caught.value.status == 499
    assert releases.times() == [1]
    assert recorder.settled == []  # no answer came: nothing to settle
    s.assert_all_released()


async def test_a_stream_whose_client_left_before_its_first_chunk_is_settled_once() -> None:
    """The server never iterates the body: the response's close releases and settles it."""
    s = await setup()
    releases, recorder = watch(s.registry), recorded(s)
    _, response = await s.forward(raw_chat(stream=True))

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        await asyncio.Event().wait()  # a client that takes nothing

    await asyncio.wait_for(response(ASGI_23, receive, send), timeout=5)
    assert releases.times() == [1]
    assert len(recorder.settled) == 1 and recorder.settled[0].streamed
    s.assert_all_released()


async def test_a_stream_whose_client_left_after_the_first_byte_is_settled_once() -> None:
    s = await setup()
    releases, recorder = watch(s.registry), recorded(s)
    for name in s.registry.replicas:  # one chunk, then the engine is still generating
        s.fleet.behaviour[name] = lambda _: Answer(200, "text/event-stream", one_then_hang())
    _, response = await s.forward(raw_chat(stream=True))
    first = asyncio.Event()

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body" and message["body"]:
            first.set()

    await asyncio.wait_for(response(ASGI_23, disconnect_once(first), send), timeout=5)
    assert releases.times() == [1]
    (settled,) = recorder.settled
    assert settled.ttft_s is not None and settled.answered
    s.assert_all_released()


async def one_then_hang() -> Any:
    yield SSE[0]
    await asyncio.Event().wait()


async def test_a_stream_broken_upstream_is_settled_once_and_released_once() -> None:
    s = await setup()
    releases, recorder = watch(s.registry), recorded(s)

    def breaks(request: Sent) -> Answer:
        broken = delayed(SSE[:1], then=UpstreamDisconnected("connection reset"))
        return Answer(200, "text/event-stream", broken)

    for name in s.registry.replicas:
        s.fleet.behaviour[name] = breaks
    _, response = await s.forward(raw_chat(stream=True))
    assert b"upstream_unavailable" in await read_all(response)
    assert releases.times() == [1]
    assert len(recorder.settled) == 1
    s.assert_all_released()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_an_upstream_error_on_every_replica_releases_each_try_once(stream: bool) -> None:
    s = await setup()
    releases, recorder = watch(s.registry), recorded(s)
    for name in s.registry.replicas:
        s.fleet.behaviour[name] = refuses
    with pytest.raises(ApiError) as caught:
        await s.forward(raw_chat(stream=stream))
    assert caught.value.status == 502
    assert releases.times() == [1, 1, 1]  # three tries (retries=2), each released once
    assert recorder.settled == []
    s.assert_all_released()


async def test_a_retry_releases_the_first_choice_and_holds_the_second_until_the_end() -> None:
    s = await setup()
    releases, recorder = watch(s.registry), recorded(s)
    plan = await s.plan(json.loads(raw_chat(stream=True)))
    first, second = plan.decision.ranking[:2]
    s.fleet.behaviour[first.removeprefix("http://")] = refuses
    reserved = s.proxy.reserve_first(plan)
    assert reserved is not None and reserved.holds(plan.replicas[first])
    response = await s.proxy.forward("chat", raw_chat(stream=True), plan, reserved=reserved)
    assert releases.times() == [1, 0]  # the first choice's reservation given back, once
    assert (plan.replicas[first].in_flight, plan.replicas[second].in_flight) == (0, 1)
    await read_all(response)
    assert releases.times() == [1, 1]
    assert [x.replica.name for x in recorder.settled] == [second]
    s.assert_all_released()


async def test_a_reserved_first_choice_that_forward_never_tries_is_released_once() -> None:
    """The handler fails between the decision and forward(): its own finally releases."""
    s = await setup()
    releases = watch(s.registry)
    plan = await s.plan(json.loads(raw_chat()))
    reserved = s.proxy.reserve_first(plan)
    assert reserved is not None
    reserved.release()
    reserved.release()
    assert releases.times() == [1]
    assert_idle(s.registry)


# -- held by flow control, then the client leaves ------------------------------------------------


@contextmanager
def busy(gw: Gateway) -> Iterator[list[Lease]]:
    """Every replica's prefill queue far over the class's budget: requests are held."""
    leases = [
        Lease(gw.registry.reserve(r, prefill_tokens=10**7, swaps=0))
        for r in gw.registry.replicas.values()
    ]
    try:
        yield leases
    finally:
        for lease in leases:
            lease.release()


def client(gone: Callable[[], Awaitable[bool]]) -> Request:
    """What `_hold` asks of the handler's request: whether its client has left."""

    class Stub:
        is_disconnected = staticmethod(gone)

    return cast(Request, Stub())


@asynccontextmanager
async def held_gateway() -> AsyncIterator[Gateway]:
    """A gateway whose standard class may wait 1 ms for its first token, before one replica."""
    data = {
        "engine_metrics": {"enabled": False},
        "classes": {"standard": {"ttft_budget_ms": 1}},
        "pools": [{"name": "p", "replicas": [URLS[0]], "models": [MODEL]}],
    }
    async with httpx.AsyncClient() as http:
        gw = build_gateway(parse_config(data), http, FakeFleet())
        for replica in gw.registry.replicas.values():
            await gw.registry.mark_ok(replica, frozenset())
        assert gw.flow is not None
        gw.flow.arrived(TenantClass.CRITICAL)  # standard is held only for a more urgent class
        yield gw


async def test_a_held_request_whose_client_leaves_reserves_nothing() -> None:
    async with held_gateway() as gw:
        releases = watch(gw.registry)
        with busy(gw):
            plan = await gw.planner.plan("chat", json.loads(raw_chat()), STANDARD)
            assert dispatch_now(gw, plan) is None  # over its budget: held
            with pytest.raises(ApiError) as caught:
                await _hold(gw, client(gone_at_poll(2)), plan)
            assert caught.value.status == 499
            assert gw.flow is not None and gw.flow.stats()["standard"]["depth"] == 0
        assert releases.times() == [1]  # the busy load's; the held request reserved nothing
        assert_idle(gw.registry)


async def test_a_request_dispatched_as_its_client_leaves_is_released_once() -> None:
    """Flow control lets the request go in the very poll that finds its client gone: the
    reservation made with its dispatch is handed to no one, and released."""
    async with held_gateway() as gw:
        releases = watch(gw.registry)
        (replica,) = gw.registry.replicas.values()
        with busy(gw) as load:
            plan = await gw.planner.plan("chat", json.loads(raw_chat()), STANDARD)
            polls = 0

            async def gone() -> bool:
                nonlocal polls
                polls += 1
                if polls < 2:
                    return False
                for lease in load:
                    lease.release()  # the load drops: flow control dispatches the held one
                for _ in range(100):  # a few steps of the loop: it reserves and returns
                    await asyncio.sleep(0)
                assert replica.in_flight == 1
                return True

            with pytest.raises(ApiError) as caught:
                await _hold(gw, client(gone), plan)
            assert caught.value.status == 499
        assert releases.times() == [1, 1]  # the busy load, then the dispatched request
        assert_idle(gw.registry)


async def test_work_that_finished_as_its_waiter_was_cancelled_is_let_go_of() -> None:
    """The handler is cancelled from above (the server shutting down) while it asks whether
    its client left, and the work it waited for has just finished: what the work holds is
    given to `abandoned` rather than lost."""
    s = await setup()
    releases = watch(s.registry)
    replica = next(iter(s.registry.replicas.values()))
    asking, go = asyncio.Event(), asyncio.Event()
    let_go: list[Lease] = []

    async def work() -> Lease:
        await go.wait()
        return Lease(s.registry.reserve(replica, prefill_tokens=10, swaps=0))

    async def gone() -> bool:
        asking.set()
        await asyncio.Event().wait()  # where the cancellation lands
        return False

    async def abandoned(lease: Lease) -> None:
        let_go.append(lease)
        lease.release()

    waiter = asyncio.ensure_future(while_client_waits(work(), gone, abandoned=abandoned))
    await asyncio.wait_for(asking.wait(), timeout=5)
    go.set()
    for _ in range(100):  # bounded: a few steps of the loop, until the work has returned
        if replica.in_flight:
            break
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert len(let_go) == 1
    assert releases.times() == [1]
    assert_idle(s.registry)


async def test_work_that_returned_though_its_client_left_is_let_go_of() -> None:
    """The watcher finds the client gone and cancels the work, which holds the cancellation off
    and returns what it reserved: that is handed to `abandoned` rather than lost, and the
    waiter says the client left."""
    s = await setup()
    releases = watch(s.registry)
    replica = next(iter(s.registry.replicas.values()))
    let_go: list[Lease] = []

    async def work() -> Lease:
        lease = Lease(s.registry.reserve(replica, prefill_tokens=10, swaps=0))
        try:
            await asyncio.Event().wait()  # where the watcher's cancellation lands
        except asyncio.CancelledError:
            await asyncio.sleep(0)  # held off: the work goes on and returns
        return lease

    async def gone() -> bool:
        return True

    async def abandoned(lease: Lease) -> None:
        let_go.append(lease)
        lease.release()

    with pytest.raises(ClientGone):
        await asyncio.wait_for(while_client_waits(work(), gone, abandoned=abandoned), timeout=5)
    assert len(let_go) == 1
    assert releases.times() == [1]
    assert_idle(s.registry)


async def test_a_waiter_cancelled_from_above_while_its_client_is_asked_about_lets_go() -> None:
    """The handler is cancelled from above (the server shutting down) while the watcher asks
    whether its client left: the work is cancelled where it waits and releases what it holds,
    once; the cancellation propagates (it is not taken for the client leaving); the watcher
    stops asking."""
    s = await setup()
    releases = watch(s.registry)
    replica = next(iter(s.registry.replicas.values()))
    asking, stopped = asyncio.Event(), asyncio.Event()

    async def work() -> None:
        with Lease(s.registry.reserve(replica, prefill_tokens=10, swaps=0)):
            await asyncio.Event().wait()

    async def gone() -> bool:
        asking.set()
        try:
            await asyncio.Event().wait()
        finally:
            stopped.set()
        return False

    waiter = asyncio.ensure_future(while_client_waits(work(), gone))
    await asyncio.wait_for(asking.wait(), timeout=5)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.wait_for(stopped.wait(), timeout=5)
    assert releases.times() == [1]
    assert_idle(s.registry)


async def test_a_streamed_request_answered_whole_with_an_error_is_timed_as_before() -> None:
    """A request that asked to stream and got a whole 4xx body: its time to that body counts
    in cachelane_ttft_seconds, as it did before the settlement was one list of observers."""
    s = await setup()
    for name in s.registry.replicas:
        s.fleet.behaviour[name] = lambda _: json_answer(400, {"error": {"message": "no"}})
    plan, response = await s.forward(raw_chat(stream=True))
    assert response.status_code == 400
    labels = {"replica": plan.decision.replica, "model": MODEL, "mode": "stream"}
    assert metric(s, "cachelane_ttft_seconds_count", **labels) == 1
    s.assert_all_released()


class Steps(Observer):
    """Records when the acceptance's work ends and when the first byte's begins."""

    def __init__(self) -> None:
        self.steps: list[str] = []

    async def on_accepted(self, plan: Any, replica: Any) -> None:
        for _ in range(3):  # an index write that awaits (the Redis index does)
            await asyncio.sleep(0)
        self.steps.append("accepted")

    async def on_first_byte(self, plan: Any, reservation: Reservation, ttft_s: float) -> None:
        self.steps.append("first byte")


async def test_the_prompt_sent_is_recorded_before_the_first_bytes_observers_run() -> None:
    """The acceptance's work runs beside the first chunk's read, and ends before it is used."""
    s = await setup()
    steps = Steps()
    chain = [*observers(s.planner, s.metrics, s.learner).observers, steps]
    s.proxy = Proxy(s.fleet, s.registry, s.metrics, Settlement(chain), UpstreamConfig(retries=2))
    _, response = await s.forward(raw_chat(stream=True, **ASKS_USAGE))
    assert b"".join(SSE) == await read_all(response)
    assert steps.steps == ["accepted", "first byte"]
    s.assert_all_released()


class Gated(Observer):
    """An acceptance that ends only when the test opens its gate (an index write still under
    way when the replica's first chunk arrives); records each step as it happens."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.steps: list[str] = []

    async def on_accepted(self, plan: Any, replica: Any) -> None:
        await self.gate.wait()
        self.steps.append("accepted")

    async def on_first_byte(self, plan: Any, reservation: Reservation, ttft_s: float) -> None:
        self.steps.append("first byte")


async def gated_setup() -> tuple[Setup, Gated]:
    s = await setup()
    gated = Gated()
    chain = [*observers(s.planner, s.metrics, s.learner).observers, gated]
    s.proxy = Proxy(s.fleet, s.registry, s.metrics, Settlement(chain), UpstreamConfig(retries=2))
    return s, gated


async def test_the_first_chunk_goes_to_the_client_before_the_first_bytes_work() -> None:
    """The acceptance still under way at the first chunk, and the first byte's observers, run
    after that chunk is handed on: the client does not wait for them."""
    s, gated = await gated_setup()
    _, response = await s.forward(raw_chat(stream=True, **ASKS_USAGE))
    chunks = stream_of(response)
    first = await anext(chunks)
    assert gated.steps == []
    gated.gate.set()
    rest = [bytes(c) async for c in chunks]
    assert bytes(first) + b"".join(rest) == b"".join(SSE)
    assert gated.steps == ["accepted", "first byte"]
    s.assert_all_released()


async def test_a_stream_never_sent_still_runs_the_first_bytes_work() -> None:
    """A client gone before its first byte: the response is closed unsent, and the acceptance
    and the first byte's observers still run before the answer is settled."""
    s, gated = await gated_setup()
    _, response = await s.forward(raw_chat(stream=True, **ASKS_USAGE))
    assert isinstance(response, RelayResponse)
    gated.gate.set()
    await response.close_upstream()
    assert gated.steps == ["accepted", "first byte"]
    s.assert_all_released()
