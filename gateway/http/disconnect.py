"""Work done for a client that may leave: given up as soon as it does.

uvicorn does not cancel a handler whose client has gone, so a request held by flow control, or
waiting for its replica's answer, would otherwise keep its place, its load reservation and the
engine's work. `while_client_waits` runs the work in the caller's own task and, once the work has
taken DISCONNECT_POLL_S, asks `client_gone` (Starlette's `Request.is_disconnected`) every
DISCONNECT_POLL_S until the work is done.

The asking is done by a watcher task started by a timer (`TaskWatch`, which
gateway/serving/relay_response.py's stream uses too): work done within DISCONNECT_POLL_S (a
request not held, whose replica begins its answer that fast) pays a timer, not a task and a wait
per poll; a client that leaves is noticed as fast as before, at the first poll after
DISCONNECT_POLL_S. A watcher that finds the client gone cancels the caller's task, so the work is
cancelled where it waits and lets go of what it holds, as on any cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

import anyio

T = TypeVar("T")

DISCONNECT_POLL_S = 0.1  # a client that leaves is noticed this fast


class ClientGone(Exception):
    """The client left before the work was done; the work was cancelled."""


async def while_client_waits(
    work: Awaitable[T],
    client_gone: Callable[[], Awaitable[bool]],
    *,
    abandoned: Callable[[T], Awaitable[None]] | None = None,
) -> T:
    """`work`'s result, or ClientGone once the client has left and `work` is cancelled. Work
    that finished meanwhile is handed to `abandoned` (nobody will read it: let go of what it
    holds): work that returned while the client was being asked about, and the answer was that
    it left (the answer decides, as when the waiter asked itself), or that held the cancellation
    off. Work that finished as the waiter was cancelled from above is let go of too."""
    task = asyncio.current_task()
    assert task is not None  # a request is handled in a task
    watch = TaskWatch(task, partial(_poll, client_gone), DISCONNECT_POLL_S)
    try:
        result = await work
    except BaseException:
        watch.stop()  # before any await: the watcher cancels only the work above
        if watch.left and task.uncancel() == 0:  # the watcher's cancellation, and only it
            raise ClientGone from None
        raise
    try:
        gone = await watch.finish()
    except BaseException:  # cancelled from above while the last question was answered
        await _let_go(result, abandoned)
        raise
    if watch.left:  # the work returned though the watcher cancelled it
        task.uncancel()
    if gone:
        await _let_go(result, abandoned)
        raise ClientGone
    return result


async def _poll(client_gone: Callable[[], Awaitable[bool]], watch: TaskWatch) -> bool:
    """Asks `client_gone` every DISCONNECT_POLL_S while the work is under way."""
    while True:
        watch.asking = True
        gone = await client_gone()
        watch.asking = False
        if gone or not watch.waiting:
            return gone
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _let_go(result: T, abandoned: Callable[[T], Awaitable[None]] | None) -> None:
    if abandoned is not None:
        with anyio.CancelScope(shield=True):
            await abandoned(result)


class TaskWatch:
    """A watcher of a client, for a task doing work on its behalf: a timer armed now starts it
    after `after_s` (work over by then pays the timer, not a task); it runs `find_gone(watch)`,
    which returns whether the client left (True) or that it stopped looking (False), and cancels
    the task if the client left while the work was still under way. `left`: the cancellation was
    this watch's; `gone`: the client left, found before or just after the work ended; `asking`:
    `find_gone` is waiting on an answer that decides (`finish` waits for it). A `find_gone` that
    raises says nothing of the client: the watch stops looking."""

    __slots__ = ("_find_gone", "_task", "_timer", "_watcher", "asking", "gone", "left", "waiting")

    def __init__(
        self,
        task: asyncio.Task[object],
        find_gone: Callable[[TaskWatch], Awaitable[bool]],
        after_s: float,
    ) -> None:
        self._task = task
        self._find_gone = find_gone
        self._watcher: asyncio.Task[None] | None = None
        self.waiting = True
        self.asking = self.gone = self.left = False
        self._timer = asyncio.get_running_loop().call_later(after_s, self._start)

    def _start(self) -> None:
        if self.waiting:
            self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        try:
            gone = await self._find_gone(self)
        except Exception:  # looking failed: that says nothing of the client, stop looking
            self.asking = False
            return
        self.gone = gone
        if gone and self.waiting:
            self.left = True
            self._task.cancel()

    def stop(self) -> None:
        """The work is over: no watcher starts, a running one is cancelled."""
        self.waiting = False
        self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()

    async def finish(self) -> bool:
        """Stop watching once the work returned: whether the client left. A question under way
        is answered first (its answer decides, as when the waiter asked itself)."""
        self.waiting = False
        self._timer.cancel()
        watcher = self._watcher
        if watcher is not None and self.asking:
            await watcher
        self.stop()
        return self.gone
