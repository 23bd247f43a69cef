"""Work done for a client that may leave: given up as soon as it does.

uvicorn does not cancel a handler whose client has gone, so a request held by flow control, or
waiting for its replica's answer, would otherwise keep its place, its load reservation and the
engine's work. `while_client_waits` runs the work in the caller's own task and, once the work has
taken DISCONNECT_POLL_S, asks `client_gone` (Starlette's `Request.is_disconnected`) every
DISCONNECT_POLL_S until the work is done.

The asking is done by a watcher task started by a timer: work done within DISCONNECT_POLL_S (a
request not held, whose replica begins its answer that fast) pays a timer, not a task and a wait
per poll; a client that leaves is noticed as fast as before, at the first poll after
DISCONNECT_POLL_S. A watcher that finds the client gone cancels the caller's task, so the work is
cancelled where it waits and lets go of what it holds, as on any cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
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
    watch = _Watch(task, client_gone)
    timer = asyncio.get_running_loop().call_later(DISCONNECT_POLL_S, watch.start)
    try:
        result = await work
    except BaseException:
        watch.stop()  # before any await: the watcher cancels only the work above
        if watch.left and task.uncancel() == 0:  # the watcher's cancellation, and only it
            raise ClientGone from None
        raise
    finally:
        timer.cancel()
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


async def _let_go(result: T, abandoned: Callable[[T], Awaitable[None]] | None) -> None:
    if abandoned is not None:
        with anyio.CancelScope(shield=True):
            await abandoned(result)


class _Watch:
    """Started by the timer: asks `client_gone` every DISCONNECT_POLL_S, and cancels the task
    still doing the work once the client has left (`left`: the cancellation was this watch's;
    `gone`: the client left, found before or just after the work returned)."""

    __slots__ = ("_client_gone", "_task", "_watcher", "asking", "gone", "left", "waiting")

    def __init__(
        self, task: asyncio.Task[object], client_gone: Callable[[], Awaitable[bool]]
    ) -> None:
        self._task = task
        self._client_gone = client_gone
        self._watcher: asyncio.Task[None] | None = None
        self.waiting = True
        self.asking = self.gone = self.left = False

    def start(self) -> None:
        if self.waiting:
            self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        try:
            while True:
                self.asking = True
                gone = await self._client_gone()
                self.asking = False
                if gone or not self.waiting:
                    break
                await asyncio.sleep(DISCONNECT_POLL_S)
        except Exception:  # asking failed: that says nothing of the client, stop asking
            self.asking = False
            return
        self.gone = gone
        if gone and self.waiting:
            self.left = True
            self._task.cancel()

    def stop(self) -> None:
        self.waiting = False
        if self._watcher is not None:
            self._watcher.cancel()

    async def finish(self) -> bool:
        """Stop watching once the work returned: whether the client left. A question under way
        is answered first (its answer decides, as when the waiter asked itself)."""
        self.waiting = False
        watcher = self._watcher
        if watcher is not None and self.asking:
            await watcher
        self.stop()
        return self.gone
