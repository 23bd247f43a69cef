"""The KV index: (model, block hash) -> the locations that hold that block.

`Index` is the interface every backend implements (memory here, Redis in index_redis.py); one
contract suite (tests/contract) runs against all of them. `lookup` answers, in one round trip,
which locations hold each leading block of a prompt, and stops at the first block that nobody
holds: a block past a miss cannot be part of any cached prefix.

Bounds: every entry has a TTL, and each location holds at most its capacity in blocks (LRU).
When a replica's HBM entry is pushed out and that replica has a CPU tier, the entry moves to the
CPU tier instead of disappearing, as the engine's offload would do (`spill_to`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from routing.types import BlockHits, Location, Tier

DEFAULT_TTL_S = 600.0
# Speculative entries expire after 10 minutes: the same order as vLLM's prefix-cache lifetime under
# steady load; engines' KV events (precise mode) refresh or remove entries long before that.


class Index(Protocol):
    async def lookup(self, model: str, hashes: Sequence[int]) -> BlockHits: ...

    async def record(self, model: str, hashes: Sequence[int], location: Location) -> None: ...

    async def evict(self, model: str, hashes: Sequence[int], location: Location) -> None: ...

    async def drop_location(self, location: Location) -> None: ...

    async def drop_replica(self, replica: str) -> None: ...

    async def close(self) -> None: ...


CapacityFn = Callable[[Location], int | None]
SpillFn = Callable[[Location], Location | None]


def _no_capacity(_: Location) -> int | None:
    return None


def _no_spill(_: Location) -> Location | None:
    return None


class MemoryIndex:
    """In-process index for one gateway (the embedded default)."""

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        capacity_blocks: CapacityFn = _no_capacity,
        spill_to: SpillFn = _no_spill,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl_s = ttl_s
        self._capacity = capacity_blocks
        self._spill_to = spill_to
        self._clock = clock
        # (model, hash) -> {location: expiry}
        self._blocks: dict[tuple[str, int], dict[Location, float]] = {}
        # location -> LRU of (model, hash), oldest first
        self._lru: dict[Location, OrderedDict[tuple[str, int], None]] = {}

    async def lookup(self, model: str, hashes: Sequence[int]) -> BlockHits:
        return self.lookup_now(model, hashes)

    def lookup_now(self, model: str, hashes: Sequence[int]) -> BlockHits:
        now = self._clock()
        hits: BlockHits = []
        for h in hashes:
            holders = self._blocks.get((model, h))
            if not holders:
                break
            alive = frozenset(loc for loc, expiry in holders.items() if expiry > now)
            if not alive:
                break
            hits.append(alive)
        return hits

    async def record(self, model: str, hashes: Sequence[int], location: Location) -> None:
        self.record_now(model, hashes, location)

    def record_now(self, model: str, hashes: Sequence[int], location: Location) -> None:
        expiry = self._clock() + self._ttl_s
        lru = self._lru.setdefault(location, OrderedDict())
        for h in hashes:
            key = (model, h)
            self._blocks.setdefault(key, {})[location] = expiry
            lru[key] = None
            lru.move_to_end(key)
        capacity = self._capacity(location)
        if capacity is None:
            return
        overflow: list[int] = []
        overflow_model = model
        while len(lru) > capacity:
            (old_model, old_hash), _ = lru.popitem(last=False)
            self._forget(old_model, old_hash, location)
            if old_model == overflow_model:
                overflow.append(old_hash)
            else:
                self._spill(old_model, [old_hash], location)
        self._spill(overflow_model, overflow, location)

    def _spill(self, model: str, hashes: list[int], location: Location) -> None:
        target = self._spill_to(location)
        if hashes and target is not None:
            self.record_now(model, hashes, target)

    def _forget(self, model: str, h: int, location: Location) -> None:
        holders = self._blocks.get((model, h))
        if holders is None:
            return
        holders.pop(location, None)
        if not holders:
            del self._blocks[(model, h)]

    async def evict(self, model: str, hashes: Sequence[int], location: Location) -> None:
        lru = self._lru.get(location)
        for h in hashes:
            self._forget(model, h, location)
            if lru is not None:
                lru.pop((model, h), None)

    async def drop_location(self, location: Location) -> None:
        for model, h in self._lru.pop(location, OrderedDict()):
            self._forget(model, h, location)

    async def drop_replica(self, replica: str) -> None:
        for tier in (Tier.HBM, Tier.CPU):
            await self.drop_location(Location(replica, tier))

    async def close(self) -> None:
        return None

    def size(self, location: Location) -> int:
        return len(self._lru.get(location, ()))
