"""A shared index (Redis) backed by a local one, so that losing Redis never fails a request.

Every write goes to both: the local MemoryIndex always, the shared index while it answers. A
lookup asks the shared index (it holds what every gateway recorded) with a deadline; when that
fails or times out, the index turns *degraded*: lookups answer from the local view (what this
gateway recorded itself) and writes stay local, so nobody waits on a dead Redis. While degraded,
at most one request per `retry_after_s` also tries the shared index, in the background; the
first success ends the outage, and the writes made during it (up to RESYNC_MAX_OPS, oldest
dropped first) are replayed to the shared index in order, so drops of restarted replicas are not
lost. Replayed records get a fresh TTL (they were made at most the outage's length ago).

Errors never leave this class: each one goes to `on_error(op, error)` (the gateway counts them).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from routing.index import Index, MemoryIndex
from routing.types import BlockHits, Location

DEFAULT_DEADLINE_S = 0.25
# A whole shared-index call, on top of the client's own socket timeout: the same 250 ms, past
# which routing on the local view is better than waiting (RedisIndex's DEFAULT_SOCKET_TIMEOUT_S).
DEFAULT_RETRY_AFTER_S = 1.0  # one probe of a lost Redis per second: quick recovery, no hammering
RESYNC_MAX_OPS = 4096
# Writes kept for replay after an outage: ~a minute of a busy gateway's records; older ones age
# out of the shared index by TTL anyway.

MAX_PENDING_WRITES = 256
# Background records in flight: at ~7 ms each (an 8k-token prompt, loadtest/bench/index.py) that
# is ~2 s of Redis work queued, past which recording applies backpressure.

ErrorHook = Callable[[str, BaseException], None]


def _ignore(_op: str, _error: BaseException) -> None:
    return None


class ResilientIndex:
    """`shared` when it answers, `local` when it does not; see the module docstring."""

    def __init__(
        self,
        shared: Index,
        local: MemoryIndex,
        *,
        deadline_s: float = DEFAULT_DEADLINE_S,
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
        on_error: ErrorHook = _ignore,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shared = shared
        self.local = local
        self._deadline_s = deadline_s
        self._retry_after_s = retry_after_s
        self._on_error = on_error
        self._clock = clock
        self.degraded = False
        self.since: float | None = None  # wall-clock time (epoch s) the outage began
        self._next_probe_s = 0.0
        self._probe: asyncio.Task[None] | None = None
        self._missed: deque[tuple[str, tuple[Any, ...]]] = deque(maxlen=RESYNC_MAX_OPS)
        self._pending: set[asyncio.Task[None]] = set()

    # the Index protocol

    async def lookup(self, model: str, hashes: Sequence[int]) -> BlockHits:
        if self.degraded:
            self._maybe_probe(model, hashes)
            return self.local.lookup_now(model, hashes)
        try:
            async with asyncio.timeout(self._deadline_s):
                return await self.shared.lookup(model, hashes)
        except Exception as err:  # the index must never fail a request
            self._failed("lookup", err)
            return self.local.lookup_now(model, hashes)

    async def record(self, model: str, hashes: Sequence[int], location: Location) -> None:
        """Local now; shared in the background (a Redis record of a long prompt is a few ms of
        Lua, which must not delay the request being routed). Past MAX_PENDING_WRITES in flight,
        the caller waits, so a slow Redis slows recording rather than growing memory."""
        self.local.record_now(model, hashes, location)  # raises on a misconfigured spill_to
        write = self._write("record", (model, list(hashes), location))
        if len(self._pending) >= MAX_PENDING_WRITES:
            await write
            return
        task = asyncio.create_task(write)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def flush(self) -> None:
        """Wait for background writes to the shared index (tests, shutdown)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def evict(self, model: str, hashes: Sequence[int], location: Location) -> None:
        await self.local.evict(model, hashes, location)
        await self._write("evict", (model, list(hashes), location))

    async def drop_location(self, location: Location) -> None:
        await self.local.drop_location(location)
        await self._write("drop_location", (location,))

    async def drop_replica(self, replica: str) -> None:
        await self.local.drop_replica(replica)
        await self._write("drop_replica", (replica,))

    async def close(self) -> None:
        await self.flush()
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        await self.local.close()
        try:
            await self.shared.close()
        except Exception as err:
            self._on_error("close", err)

    # outage handling

    async def _write(self, op: str, args: tuple[Any, ...]) -> None:
        if self.degraded:
            self._missed.append((op, args))
            return
        try:
            async with asyncio.timeout(self._deadline_s):
                await self._shared_op(op, args)
        except Exception as err:
            self._missed.append((op, args))
            self._failed(op, err)

    def _shared_op(self, op: str, args: tuple[Any, ...]) -> Awaitable[None]:
        method: Callable[..., Awaitable[None]] = getattr(self.shared, op)
        return method(*args)

    def _failed(self, op: str, err: BaseException) -> None:
        self._on_error(op, err)
        if not self.degraded:
            self.degraded = True
            self.since = time.time()
            self._next_probe_s = self._clock() + self._retry_after_s

    def _maybe_probe(self, model: str, hashes: Sequence[int]) -> None:
        now_s = self._clock()
        if now_s < self._next_probe_s or (self._probe is not None and not self._probe.done()):
            return
        self._next_probe_s = now_s + self._retry_after_s
        probe_hashes = list(hashes[:1]) or [0]  # an empty lookup would not reach Redis
        self._probe = asyncio.create_task(self._try_recover(model, probe_hashes))

    async def _try_recover(self, model: str, hashes: list[int]) -> None:
        """One lookup against the shared index; on success, replay the missed writes."""
        try:
            async with asyncio.timeout(self._deadline_s):
                await self.shared.lookup(model, hashes)
            while self._missed:
                op, args = self._missed[0]
                async with asyncio.timeout(self._deadline_s):
                    await self._shared_op(op, args)
                self._missed.popleft()
        except Exception as err:
            self._on_error("probe", err)
            return
        self.degraded = False
        self.since = None
