"""Flow control: dispatch order between and within classes, no overtaking, shedding (queue full,
max wait), cancellation, and the recheck loop. The clock is fake wherever a wait is measured;
every await is bounded by a short timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from gateway.serving.flow import ClassLimits, FlowControl, Shed
from routing.types import TenantClass

C, S, B = TenantClass.CRITICAL, TenantClass.STANDARD, TenantClass.BATCH
TIMEOUT_S = 1.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Gate:
    """A shared ready() predicate the test opens and closes."""

    def __init__(self, is_open: bool = False) -> None:
        self.is_open = is_open

    def __call__(self) -> bool:
        return self.is_open


def flow(
    max_queue: int = 10, max_wait_s: float = 5.0, clock: Callable[[], float] | None = None
) -> FlowControl:
    limits = {c: ClassLimits(max_queue, max_wait_s) for c in TenantClass}
    if clock is None:
        return FlowControl(limits, recheck_s=0.01)
    return FlowControl(limits, clock=clock, recheck_s=0.01)


async def settle() -> None:
    """Let every runnable task take its next step(s)."""
    for _ in range(5):
        await asyncio.sleep(0)


def start(
    fc: FlowControl, tenant: str, cls: TenantClass, ready: Callable[[], bool]
) -> asyncio.Task[float]:
    return asyncio.create_task(fc.admit(tenant, cls, ready))


async def two_waiting_then_ready() -> tuple[FlowControl, asyncio.Task[float], asyncio.Task[float]]:
    """Two standard requests that wait in turn, a's first; then the replica becomes ready (no
    kick yet)."""
    fc, gate = flow(), Gate(False)
    first = start(fc, "a", S, gate)
    second = start(fc, "b", S, gate)
    await settle()
    gate.is_open = True
    return fc, first, second


async def test_dispatches_at_once_when_ready_without_suspending() -> None:
    fc = flow()
    coro = fc.admit("a", S, Gate(True))
    with pytest.raises(StopIteration) as done:  # no await reached: no future, no task switch
        coro.send(None)
    assert done.value.value == 0.0
    assert fc.waiting() == {"critical": 0, "standard": 0, "batch": 0}
    assert fc.stats()["standard"]["dispatched"] == 1


@pytest.mark.parametrize(
    ("arrivals", "expected"),
    [
        ([("s1", "t1", S), ("c1", "t2", C)], ["c1", "s1"]),
        ([("b1", "t1", B), ("s1", "t1", S), ("c1", "t1", C)], ["c1", "s1", "b1"]),
        (
            [("a1", "A", S), ("a2", "A", S), ("a3", "A", S), ("b1", "B", S)],
            ["a1", "b1", "a2", "a3"],
        ),
        (
            [("a1", "A", B), ("a2", "A", B), ("b1", "B", B), ("b2", "B", B)],
            ["a1", "b1", "a2", "b2"],
        ),
        ([("a1", "A", S), ("a2", "A", S), ("a3", "A", S)], ["a1", "a2", "a3"]),
    ],
    ids=[
        "critical-before-earlier-standard",
        "class-order",
        "round-robin-newcomer-second",
        "round-robin-alternates",
        "fifo-within-tenant",
    ],
)
async def test_dispatch_order(
    arrivals: list[tuple[str, str, TenantClass]], expected: list[str]
) -> None:
    """All queue while the gate is shut; then each dispatched request 'reserves' and kicks, as
    the gateway does."""
    fc, gate, order = flow(), Gate(False), []

    async def request(name: str, tenant: str, cls: TenantClass) -> None:
        await fc.admit(tenant, cls, gate)
        order.append(name)
        fc.kick()

    tasks = []
    for name, tenant, cls in arrivals:
        tasks.append(asyncio.create_task(request(name, tenant, cls)))
        await settle()
    assert sum(fc.waiting().values()) == len(arrivals)
    gate.is_open = True
    fc.kick()
    await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
    assert order == expected
    assert sum(fc.waiting().values()) == 0


async def test_one_dispatch_per_class_per_kick() -> None:
    fc, gate = flow(), Gate(False)
    tasks = [start(fc, "a", S, gate) for _ in range(3)] + [start(fc, "b", B, gate)]
    await settle()
    gate.is_open = True
    fc.kick()
    fc.kick()  # the standard hand-off has not resumed yet: nothing more of that class
    await settle()
    assert [t.done() for t in tasks] == [True, False, False, True]
    fc.kick()  # what the first request does after reserving
    await settle()
    assert [t.done() for t in tasks] == [True, True, False, True]
    fc.kick()
    await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)


@pytest.mark.parametrize(
    ("waiting_class", "arrival_class", "queues"),
    [(S, S, True), (C, S, True), (C, B, True), (B, S, False), (S, C, False)],
    ids=["own-class", "higher-class", "much-higher-class", "lower-class", "lower-class-critical"],
)
async def test_arrival_never_overtakes_own_or_higher_class(
    waiting_class: TenantClass, arrival_class: TenantClass, queues: bool
) -> None:
    fc = flow()
    waiter = start(fc, "a", waiting_class, Gate(False))
    await settle()
    arrival = start(fc, "b", arrival_class, Gate(True))
    await settle()
    assert arrival.done() is not queues
    assert fc.waiting()[arrival_class.value] == (1 if queues else 0) + (
        1 if arrival_class is waiting_class else 0
    )
    waiter.cancel()  # its departure kicks: the arrival is the head now, and ready
    await asyncio.gather(waiter, return_exceptions=True)
    assert await asyncio.wait_for(arrival, TIMEOUT_S) >= 0.0
    assert sum(fc.waiting().values()) == 0


async def test_queued_arrival_waits_for_a_hand_off_to_resume() -> None:
    fc, gate = flow(), Gate(False)
    first = start(fc, "a", S, gate)
    await settle()
    gate.is_open = True

    async def kick_then_arrive() -> float:
        fc.kick()  # first is handed off; its task has not resumed, the view lacks its load
        return await fc.admit("b", S, gate)  # in the same step: ready, but must queue

    second = asyncio.create_task(kick_then_arrive())
    await settle()
    assert first.done() and not second.done()
    fc.kick()
    await asyncio.wait_for(second, TIMEOUT_S)


@pytest.mark.parametrize("max_queue", [0, 1, 3])
async def test_full_queue_sheds_at_once(max_queue: int) -> None:
    fc, gate = flow(max_queue=max_queue), Gate(False)
    waiters = [start(fc, f"t{i}", B, gate) for i in range(max_queue)]
    await settle()
    with pytest.raises(Shed) as shed:
        await asyncio.wait_for(fc.admit("late", B, gate), TIMEOUT_S)
    assert (shed.value.tenant_class, shed.value.reason, shed.value.retry_after_s) == (
        B,
        "queue_full",
        1,
    )
    assert fc.stats()["batch"]["shed_queue_full"] == 1
    assert fc.waiting()["batch"] == max_queue
    assert fc.waiting()["standard"] == 0, "other classes have their own queues"
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)


async def test_retry_after_follows_the_mean_wait() -> None:
    clock, gate = Clock(), Gate(False)
    fc = flow(max_queue=1, max_wait_s=10.0, clock=clock)
    first = start(fc, "a", S, gate)
    await settle()
    clock.now += 3.2
    gate.is_open = True
    fc.kick()
    assert await asyncio.wait_for(first, TIMEOUT_S) == pytest.approx(3.2)
    gate.is_open = False
    blocker = start(fc, "a", S, gate)
    await settle()
    with pytest.raises(Shed) as shed:
        await fc.admit("b", S, gate)
    assert shed.value.retry_after_s == 4  # ceil(3.2)
    blocker.cancel()
    await asyncio.gather(blocker, return_exceptions=True)


async def test_max_wait_sheds_on_fake_clock() -> None:
    clock, gate = Clock(), Gate(False)
    fc = flow(max_wait_s=2.0, clock=clock)
    old = start(fc, "a", S, gate)
    await settle()
    clock.now += 1.0
    young = start(fc, "b", S, gate)
    await settle()
    clock.now += 1.5  # old waited 2.5 s, young 1.5 s
    fc.kick()
    with pytest.raises(Shed) as shed:
        await asyncio.wait_for(old, TIMEOUT_S)
    assert (shed.value.tenant_class, shed.value.reason, shed.value.retry_after_s) == (
        S,
        "max_wait",
        3,
    )
    assert not young.done()
    assert fc.waiting()["standard"] == 1
    assert fc.stats()["standard"]["shed_max_wait"] == 1
    gate.is_open = True
    fc.kick()
    assert await asyncio.wait_for(young, TIMEOUT_S) == pytest.approx(1.5)


async def test_max_wait_sheds_by_the_recheck_loop() -> None:
    fc = FlowControl({c: ClassLimits(10, 0.03) for c in TenantClass}, recheck_s=0.01)
    loop = asyncio.create_task(fc.run())
    try:
        with pytest.raises(Shed) as shed:
            await asyncio.wait_for(fc.admit("a", C, Gate(False)), TIMEOUT_S)
        assert shed.value.reason == "max_wait"
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def test_cancelled_waiter_leaves_the_queue() -> None:
    fc, gate = flow(), Gate(False)
    first = start(fc, "a", S, gate)
    second = start(fc, "b", S, gate)
    await settle()
    assert fc.waiting()["standard"] == 2
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert fc.waiting()["standard"] == 1
    assert not second.done(), "a departure dispatches nobody who is not ready"
    gate.is_open = True
    fc.kick()
    await asyncio.wait_for(second, TIMEOUT_S)
    assert fc.waiting()["standard"] == 0
    assert fc.stats()["standard"]["cancelled"] == 1


async def test_cancelled_before_its_task_runs_is_skipped_by_kick() -> None:
    fc, first, second = await two_waiting_then_ready()
    first.cancel()  # its future is cancelled, the task has not run its cleanup yet
    fc.kick()  # must skip it and hand the turn to the next waiter
    await asyncio.wait_for(second, TIMEOUT_S)
    with pytest.raises(asyncio.CancelledError):
        await first
    assert fc.waiting()["standard"] == 0


async def test_cancelled_after_dispatch_passes_the_turn_on() -> None:
    fc, first, second = await two_waiting_then_ready()
    fc.kick()  # first is handed off; second waits for the next kick
    first.cancel()  # the client leaves before the task resumed: it never reserves
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, TIMEOUT_S)  # no explicit kick: the cancellation passed it on


@pytest.mark.parametrize(
    ("waiting_class", "asked", "expected"),
    [(S, B, True), (S, S, False), (S, C, False), (C, B, True), (C, S, True), (B, C, False)],
)
async def test_higher_class_waiting(
    waiting_class: TenantClass, asked: TenantClass, expected: bool
) -> None:
    fc = flow()
    assert not fc.higher_class_waiting(asked)
    waiter = start(fc, "a", waiting_class, Gate(False))
    await settle()
    assert fc.higher_class_waiting(asked) is expected
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert not fc.higher_class_waiting(asked)


async def test_recheck_loop_dispatches_without_kick() -> None:
    fc, gate = flow(), Gate(False)
    loop = asyncio.create_task(fc.run())
    try:
        waiter = start(fc, "a", S, gate)
        await asyncio.sleep(0.03)
        assert not waiter.done()
        gate.is_open = True  # load dropped, but nobody kicked
        assert await asyncio.wait_for(waiter, TIMEOUT_S) >= 0.0
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def test_broken_predicate_fails_only_its_request() -> None:
    fc, calls = flow(), []

    def breaks_later() -> bool:  # false on arrival, raises when a kick asks
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("boom")
        return False

    bad = start(fc, "a", C, breaks_later)
    good = start(fc, "b", S, Gate(True))  # queues: a critical request waits
    await settle()
    fc.kick()
    with pytest.raises(RuntimeError):
        await asyncio.wait_for(bad, TIMEOUT_S)
    await asyncio.wait_for(good, TIMEOUT_S)


async def test_stats_shape() -> None:
    clock = Clock()
    fc = flow(clock=clock)
    waiter = start(fc, "a", B, Gate(False))
    await settle()
    clock.now += 0.5
    stats = fc.stats()
    assert set(stats) == {"critical", "standard", "batch"}
    assert stats["batch"]["depth"] == 1
    assert stats["batch"]["oldest_wait_s"] == pytest.approx(0.5)
    assert {"dispatched", "shed_queue_full", "shed_max_wait", "wait_p50_s", "wait_p99_s"} <= set(
        stats["batch"]
    )
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)


@pytest.mark.parametrize(
    "limits",
    [
        {C: ClassLimits(1, 1.0), S: ClassLimits(1, 1.0)},  # batch missing
    ],
)
def test_limits_must_cover_every_class(limits: dict[TenantClass, ClassLimits]) -> None:
    with pytest.raises(ValueError):
        FlowControl(limits)


@pytest.mark.parametrize(("max_queue", "max_wait_s"), [(-1, 1.0), (1, 0.0), (1, -2.0)])
def test_class_limits_validated(max_queue: int, max_wait_s: float) -> None:
    with pytest.raises(ValueError):
        ClassLimits(max_queue, max_wait_s)
