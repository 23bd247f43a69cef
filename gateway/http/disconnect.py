"""Work done for a client that may leave: given up as soon as it does.

uvicorn does not cancel a handler whose client has gone, so a request held by flow control, or
waiting for its replica's answer, would otherwise keep its place, its load reservation and the
engine's work. `while_client_waits` runs the work and asks `client_gone` (Starlette's
`Request.is_disconnected`) every DISCONNECT_POLL_S until the work is done.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    holds)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await client_gone():
                break
    except BaseException:
        # cancelled itself (the server gave up on the client): the work lets go of what it
        # holds, and work that finished meanwhile is let go of here, whatever cancels us
        with anyio.CancelScope(shield=True):
            await _let_go(task, abandoned)
        raise
    await _let_go(task, abandoned)
    raise ClientGone


async def _let_go(
    task: asyncio.Future[T], abandoned: Callable[[T], Awaitable[None]] | None
) -> None:
    """Cancel the work; hand what it finished with, if it did, to `abandoned`."""
    task.cancel()
    with contextlib.suppress(Exception, asyncio.CancelledError):
        late = await task
        if abandoned is not None:
            await abandoned(late)
