"""The lifecycle of a running gateway's long-lived parts, and the one place that starts them.

A Component is anything the gateway keeps for as long as it serves: a background loop (health
checks, engine-metric scrapes, tenant refresh, ...) or a resource to close (a Redis client, the
upstream connections). The contract, which `start_all` relies on:

- `name` says what it is in logs ("health-checks", "engine-metrics").
- `start()` returns promptly: it may do a bounded first round of work that must be done before
  the gateway serves (the first health check, the first tenant read), then leaves its background
  work to a task it owns. It raises when the gateway must not serve without it.
- `aclose()` cancels that task and awaits it, then releases what the component holds. It is
  idempotent, and never raises on a component that never started or whose start failed half-way.

The gateway's components are one ordered list (gateway/wiring.py `components`); the app's
lifespan starts them in order and closes them in reverse, as starlette's lifespan hands its
resources to the handlers and takes them back (its lifespan docs, "Lifespan State").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

log = logging.getLogger("cachelane.components")

Step = Callable[[], Awaitable[Any]]
Spawn = Callable[[], "asyncio.Task[Any] | Iterable[asyncio.Task[Any]]"]


class Component(Protocol):
    @property
    def name(self) -> str: ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


async def start_all(components: Sequence[Component], stack: contextlib.AsyncExitStack) -> None:
    """Start each component in order, its aclose pushed on `stack` first (so the stack closes
    them in reverse, a half-started one included). A failing start is logged with the
    component's name and raised: the caller's stack then closes those already started."""
    for component in components:
        stack.push_async_callback(_close_logged, component)
        try:
            await component.start()
        except Exception as err:
            log.error("component %s failed to start: %r", component.name, err)
            raise


async def _close_logged(component: Component) -> None:
    """Close one component; its failure is logged and does not keep the others open."""
    try:
        await component.aclose()
    except Exception:
        log.exception("component %s failed to close", component.name)


class Resource:
    """A part with no task of its own: `opened()` at start, `closed()` once at aclose (when its
    start was attempted: a half-open resource is closed too)."""

    def __init__(
        self, name: str, *, opened: Step | None = None, closed: Step | None = None
    ) -> None:
        self.name = name
        self._opened = opened
        self._closed_by = closed
        self._started = False
        self._closed = False

    async def start(self) -> None:
        self._started = True
        if self._opened is not None:
            await self._opened()

    async def aclose(self) -> None:
        if self._closed or not self._started:
            return
        self._closed = True
        if self._closed_by is not None:
            await self._closed_by()


class Background(Resource):
    """A part whose work runs in tasks: `prepare()` (the first round, awaited), then `spawn()`
    starts its tasks; aclose cancels and awaits them, then runs `finish()` once."""

    def __init__(
        self, name: str, spawn: Spawn, *, prepare: Step | None = None, finish: Step | None = None
    ) -> None:
        super().__init__(name, opened=self._open, closed=self._cancel)
        self._spawn = spawn
        self._prepare = prepare
        self._finish = finish
        self._tasks: list[asyncio.Task[Any]] = []

    async def _open(self) -> None:
        if self._prepare is not None:
            await self._prepare()
        spawned = self._spawn()
        self._tasks = [spawned] if isinstance(spawned, asyncio.Task) else list(spawned)

    async def _cancel(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._finish is not None:
            await self._finish()


def loop(
    name: str, run: Callable[[], Awaitable[None]], *, prepare: Step | None = None
) -> Background:
    """A part whose work is one `run()` coroutine, looping until cancelled."""

    def spawn() -> asyncio.Task[None]:
        async def running() -> None:
            await run()

        return asyncio.create_task(running(), name=name)

    return Background(name, spawn, prepare=prepare)
