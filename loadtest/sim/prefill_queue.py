"""The one-at-a-time engine (`engine_model="serial"`): the replica's one prefill slot and the
queue in front of it, ordered like vLLM's --scheduling-policy. The default engine is steps.py.

"fcfs" grants the slot in arrival order; "priority" by (priority, arrival), the lower priority value
first (vLLM's semantics: an int, default 0). Arrival is when the request reached the engine, taken
with `ticket()` before its KV loads, not when it asks for the slot: vLLM keeps a request whose KV
is still loading at its place in the waiting queue (the scheduler skips it and puts it back at
the head, vllm/v1/core/sched/scheduler.py, WAITING_FOR_REMOTE_KVS), so once loaded it goes before
requests that arrived after it. Releasing hands the slot straight to the next waiter, so a request
arriving meanwhile cannot take it out of turn. A waiter cancelled while queued leaves
the queue; one cancelled after being granted but before it resumed passes the slot on.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from loadtest.sim.steps import SchedulingPolicy as SchedulingPolicy  # re-exported


class PrefillQueue:
    def __init__(self, policy: SchedulingPolicy = "fcfs") -> None:
        self.policy = policy
        self._held = False
        self._seq = itertools.count()
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []  # heap: (key, seq, future)

    @property
    def held(self) -> bool:
        return self._held

    def __len__(self) -> int:
        """Waiters not yet granted the slot."""
        return len(self._waiters)

    def ticket(self) -> int:
        """The request's place in arrival order: take it when the request arrives."""
        return next(self._seq)

    @asynccontextmanager
    async def slot(self, priority: int = 0, ticket: int | None = None) -> AsyncIterator[None]:
        """Hold the prefill slot for the block; waits for it in policy order (`ticket`: the
        request's arrival, from `ticket()`; now if not given)."""
        await self.acquire(priority, ticket)
        try:
            yield
        finally:
            self.release()

    async def acquire(self, priority: int = 0, ticket: int | None = None) -> None:
        if not self._held:  # a free slot means nobody waits: release() hands it on otherwise
            self._held = True
            return
        key = priority if self.policy == "priority" else 0
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (key, self.ticket() if ticket is None else ticket, granted)
        heapq.heappush(self._waiters, entry)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release()  # granted, then cancelled before it could run: pass it on
            else:
                granted.cancel()
                if entry in self._waiters:  # release() may have dropped it already
                    self._waiters.remove(entry)
                    heapq.heapify(self._waiters)
            raise

    def release(self) -> None:
        if not self._held:
            raise RuntimeError("release() of a prefill slot that is not held")
        while self._waiters:
            _, _, future = heapq.heappop(self._waiters)
            if not future.cancelled():  # a cancelled waiter whose task has not yet run
                future.set_result(None)  # the slot stays held: it is now the waiter's
                return
        self._held = False
