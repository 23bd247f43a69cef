"""PrefillQueue: the simulated replica's prefill slot, in fcfs or priority order
(loadtest/sim/prefill_queue.py), and the scheduling_policy that selects it."""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import ConfigError, parse_config
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.from_config import specs_from_config
from loadtest.sim.prefill_queue import PrefillQueue, SchedulingPolicy


async def settle() -> None:
    """Let every ready task run until it blocks (a few loop turns are enough here)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def grant_order(policy: SchedulingPolicy, priorities: list[int]) -> list[int]:
    """Queue one waiter per priority, in list order, behind a held slot; the order they got it."""
    queue = PrefillQueue(policy)
    order: list[int] = []

    async def waiter(i: int) -> None:
        async with queue.slot(priorities[i]):
            order.append(i)
            await asyncio.sleep(0)  # hold it across a loop turn, as a real prefill does

    await queue.acquire()
    tasks = []
    for i in range(len(priorities)):
        tasks.append(asyncio.create_task(waiter(i)))
        await settle()  # each joins the queue before the next: arrival order is list order
    assert len(queue) == len(priorities)
    queue.release()
    await asyncio.gather(*tasks)
    assert not queue.held and len(queue) == 0
    return order


@pytest.mark.parametrize(
    ("policy", "priorities", "expected"),
    [
        ("priority", [0, 5, -1, 2], [2, 0, 3, 1]),
        ("priority", [1, 0, 1, 0, 1], [1, 3, 0, 2, 4]),
        ("priority", [0, 0, 0], [0, 1, 2]),
        ("fcfs", [0, 5, -1, 2], [0, 1, 2, 3]),
    ],
    ids=["lower-first", "fifo-within-a-priority", "all-default", "fcfs-ignores-priority"],
)
async def test_grant_order(
    policy: SchedulingPolicy, priorities: list[int], expected: list[int]
) -> None:
    assert await grant_order(policy, priorities) == expected


async def test_free_slot_is_taken_at_once() -> None:
    queue = PrefillQueue("priority")
    await asyncio.wait_for(queue.acquire(5), timeout=1)
    assert queue.held and len(queue) == 0
    queue.release()
    assert not queue.held


async def test_late_arrival_cannot_take_a_slot_being_handed_on() -> None:
    queue = PrefillQueue("fcfs")
    order: list[str] = []

    async def take(name: str) -> None:
        async with queue.slot():
            order.append(name)

    await queue.acquire()
    first = asyncio.create_task(take("queued"))
    await settle()
    queue.release()  # granted to "queued", which has not run yet
    late = asyncio.create_task(take("late"))
    await asyncio.gather(first, late)
    assert order == ["queued", "late"]


async def test_cancelled_waiter_leaves_the_queue() -> None:
    queue = PrefillQueue("priority")
    order: list[str] = []

    async def take(name: str, priority: int) -> None:
        async with queue.slot(priority):
            order.append(name)

    await queue.acquire()
    gone = asyncio.create_task(take("gone", -1))
    kept = asyncio.create_task(take("kept", 0))
    await settle()
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert gone.cancelled()
    assert len(queue) == 1
    queue.release()
    await kept
    assert order == ["kept"]
    assert not queue.held and len(queue) == 0


async def test_waiter_cancelled_then_released_before_it_ran_is_skipped() -> None:
    queue = PrefillQueue("fcfs")
    gone = asyncio.create_task(queue.acquire())
    await queue.acquire()  # the holder; `gone` has not run yet
    await settle()  # now `gone` waits
    kept = asyncio.create_task(queue.acquire())
    await settle()
    gone.cancel()  # its future is cancelled at once, its task resumes later
    queue.release()  # must skip `gone`, not hand it the slot
    await asyncio.gather(gone, return_exceptions=True)
    await asyncio.wait_for(kept, timeout=1)
    assert gone.cancelled()
    assert queue.held and len(queue) == 0
    queue.release()
    assert not queue.held


async def test_waiter_cancelled_after_grant_passes_the_slot_on() -> None:
    queue = PrefillQueue("fcfs")
    await queue.acquire()
    granted = asyncio.create_task(queue.acquire())
    nxt = asyncio.create_task(queue.acquire())
    await settle()
    queue.release()  # the slot is now `granted`'s, but its task has not resumed
    granted.cancel()
    await asyncio.gather(granted, return_exceptions=True)
    assert granted.cancelled()
    await asyncio.wait_for(nxt, timeout=1)  # got the slot `granted` passed on
    assert queue.held and len(queue) == 0
    queue.release()
    assert not queue.held


async def test_cancelled_after_grant_with_nobody_waiting_frees_the_slot() -> None:
    queue = PrefillQueue("priority")
    await queue.acquire()
    granted = asyncio.create_task(queue.acquire(3))
    await settle()
    queue.release()
    granted.cancel()
    await asyncio.gather(granted, return_exceptions=True)
    assert not queue.held
    await asyncio.wait_for(queue.acquire(), timeout=1)


async def test_cancelled_holder_releases_the_slot() -> None:
    queue = PrefillQueue("fcfs")
    started = asyncio.Event()

    async def hold() -> None:
        async with queue.slot():
            started.set()
            await asyncio.sleep(3600)

    holder = asyncio.create_task(hold())
    await started.wait()
    waiter = asyncio.create_task(queue.acquire())
    await settle()
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)
    await asyncio.wait_for(waiter, timeout=1)
    queue.release()
    assert not queue.held


def test_release_of_a_free_slot_is_an_error() -> None:
    with pytest.raises(RuntimeError):
        PrefillQueue().release()


def test_spec_rejects_an_unknown_policy() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        # deliberately not a SchedulingPolicy: the runtime check is what is under test
        SimReplicaSpec(name="s", port=1, scheduling_policy="lifo")  # type: ignore[arg-type]


def test_config_passes_the_policy_to_the_simulated_replicas() -> None:
    pool = {"name": "p", "replicas": ["http://127.0.0.1:9001"]}
    default, _ = specs_from_config(parse_config({"pools": [pool]}))
    chosen, _ = specs_from_config(
        parse_config({"pools": [{**pool, "sim": {"scheduling_policy": "priority"}}]})
    )
    assert default[0].scheduling_policy == "fcfs"
    assert chosen[0].scheduling_policy == "priority"
    with pytest.raises(ConfigError, match="scheduling_policy"):
        parse_config({"pools": [{**pool, "sim": {"scheduling_policy": "lifo"}}]})


async def test_a_request_that_loaded_its_kv_keeps_its_place_in_arrival_order() -> None:
    """A request that arrived first but asks for the slot last (its KV was loading) goes before
    those that arrived after it, as vLLM's scheduler keeps a loading request at the head of its
    waiting queue."""
    queue = PrefillQueue("fcfs")
    order: list[str] = []

    async def waiter(name: str, ticket: int) -> None:
        async with queue.slot(0, ticket):
            order.append(name)
            await asyncio.sleep(0)

    await queue.acquire()
    loading = queue.ticket()  # arrived first, still loading its KV
    later = asyncio.create_task(waiter("later", queue.ticket()))
    await settle()
    loaded = asyncio.create_task(waiter("loaded", loading))
    await settle()
    queue.release()
    await asyncio.gather(later, loaded)
    assert order == ["loaded", "later"]
