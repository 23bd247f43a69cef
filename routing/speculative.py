"""Speculative entries: what a replica was just sent, until its engine holds it.

Precise mode: the index holds only what the engines' KV events report. Between sending a request
and the engine's BlockStored for its prompt (the prefill, then the next engine step) the index
does not know the replica is about to hold those blocks, and a follow-up that shares the prefix
(the next turn of a chat, a burst on one system prompt) would be routed as if nobody had it.
Approximate mode: the gateway records a prompt that loads KV from the CPU or remote tier when
its load is estimated to be done (routing/pipeline_writes.py), as the engine caches it; until
then the marks send a follow-up where the first request went.

`SpeculativeIndex` wraps the index: `speculate()` marks a prompt's blocks as held by the replica
for SPECULATIVE_TTL_S (or a given time); lookups see those marks as hits; a record settles them
(an engine's event, or the gateway's own record): a stored block becomes a real entry (the mark
is dropped), an evicted one drops the mark, and a replica that goes away loses all of its marks.
An unconfirmed mark (a template or tokenizer mismatch, a request that failed) simply expires, so
a guess can never outlive its TTL.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

from routing.index import Index, MemoryIndex
from routing.types import BlockHits, Location

SPECULATIVE_TTL_S = 10.0
# Long enough to cover a queued request's prefill and the engine step that publishes its
# BlockStored (vLLM publishes on the step that stores the blocks), short enough that a mark the
# engine never confirms stops drawing traffic within seconds.

MAX_MARKS_PER_LOCATION = 65_536
# At most 64k marked blocks per replica (1M tokens at 16-token blocks): more than any replica's
# HBM takes in one TTL, and a bound on memory if events stop.

Key = tuple[str, int]  # (model, gateway block key)


class SpeculativeIndex:
    """An `Index` (routing/index.py) whose lookups also see unconfirmed speculative marks."""

    def __init__(
        self,
        inner: Index,
        *,
        ttl_s: float = SPECULATIVE_TTL_S,
        max_marks_per_location: int = MAX_MARKS_PER_LOCATION,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = inner
        self._ttl_s = ttl_s
        self._max = max_marks_per_location
        self._clock = clock
        self._marks: dict[Key, dict[Location, float]] = {}  # key -> location -> expiry
        self._order: dict[Location, deque[tuple[float, Key]]] = {}  # per location, oldest first

    def speculate(
        self, model: str, hashes: Sequence[int], location: Location, ttl_s: float | None = None
    ) -> None:
        """The replica at `location` is being sent a prompt with these blocks; the marks last
        `ttl_s` (None: the index's TTL)."""
        now = self._clock()
        expiry = now + (self._ttl_s if ttl_s is None else ttl_s)
        order = self._order.setdefault(location, deque())
        for h in hashes:
            key = (model, h)
            self._marks.setdefault(key, {})[location] = expiry
            order.append((expiry, key))
        self._sweep(location, order, now)

    def marks(self) -> int:
        return sum(len(v) for v in self._marks.values())

    async def lookup(self, model: str, hashes: Sequence[int]) -> BlockHits:
        return self._marked(model, hashes, await self.inner.lookup(model, hashes))

    def lookup_now(self, model: str, hashes: Sequence[int]) -> BlockHits:
        """`lookup` without awaiting, over an in-memory index (the what-if replay's)."""
        assert isinstance(self.inner, MemoryIndex)
        return self._marked(model, hashes, self.inner.lookup_now(model, hashes))

    def record_now(self, model: str, hashes: Sequence[int], location: Location) -> None:
        assert isinstance(self.inner, MemoryIndex)
        self.inner.record_now(model, hashes, location)
        self._settle(model, hashes, location)

    def _marked(self, model: str, hashes: Sequence[int], hits: BlockHits) -> BlockHits:
        if not self._marks:
            return hits
        now = self._clock()
        out = list(hits)
        for i, h in enumerate(hashes):
            marked = self._marks.get((model, h))
            live = frozenset(loc for loc, exp in marked.items() if exp > now) if marked else None
            if i < len(out):
                if live:
                    out[i] = out[i] | live
            elif live:
                out.append(live)
            else:
                break
        return out

    async def record(self, model: str, hashes: Sequence[int], location: Location) -> None:
        await self.inner.record(model, hashes, location)
        self._settle(model, hashes, location)  # confirmed: the real entry takes over

    async def evict(self, model: str, hashes: Sequence[int], location: Location) -> None:
        await self.inner.evict(model, hashes, location)
        self._settle(model, hashes, location)

    async def drop_location(self, location: Location) -> None:
        await self.inner.drop_location(location)
        self._forget(lambda loc: loc == location)

    async def drop_replica(self, replica: str) -> None:
        await self.inner.drop_replica(replica)
        self._forget(lambda loc: loc.holder == replica)

    async def close(self) -> None:
        await self.inner.close()

    def _settle(self, model: str, hashes: Sequence[int], location: Location) -> None:
        if not self._marks:
            return
        for h in hashes:
            marked = self._marks.get((model, h))
            if marked is not None and marked.pop(location, None) is not None and not marked:
                del self._marks[(model, h)]

    def _forget(self, gone: Callable[[Location], bool]) -> None:
        for loc in [loc for loc in self._order if gone(loc)]:
            for _, key in self._order.pop(loc):
                marked = self._marks.get(key)
                if marked is not None:
                    marked.pop(loc, None)
                    if not marked:
                        del self._marks[key]

    def _sweep(self, location: Location, order: deque[tuple[float, Key]], now: float) -> None:
        """Drop expired marks, and the oldest past the location's bound. A deque entry whose key
        was re-marked later (a newer expiry) leaves that newer mark alone."""
        while order and (order[0][0] <= now or len(order) > self._max):
            expiry, key = order.popleft()
            marked = self._marks.get(key)
            if marked is not None and marked.get(location) == expiry:
                del marked[location]
                if not marked:
                    del self._marks[key]
