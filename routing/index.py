"""The KV index: (model, block hash) -> the locations that hold that block.

`Index` is the interface every backend implements (memory here; Redis, with its resilient
wrapper, in gateway/index/); one contract suite (tests/contract) runs against all of them.
`lookup` answers, in one round trip, which locations hold each leading block of a prompt, and
stops at the first block that nobody holds: a block past a miss cannot be part of any cached
prefix.

Bounds: every entry has a TTL, and each location holds at most its capacity in blocks (LRU).
When a replica's HBM entry is pushed out and that replica has a CPU tier, the entry moves to the
CPU tier instead of disappearing, as the engine's offload would do (`spill_to`); an entry that had
already expired is dropped, never revived. `spill_to` must not lead back to where it started: a
record whose spill chain has a cycle raises ValueError before it writes anything.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import takewhile
from operator import truth
from typing import Protocol, cast

from routing.types import BlockHits, Location, Tier

DEFAULT_TTL_S = 600.0
# Speculative entries expire after 10 minutes: the same order as vLLM's prefix-cache lifetime under
# steady load; engines' KV events (precise mode) refresh or remove entries long before that.
FREEZE_MARGIN = 0.05
# A block's holders are kept built (frozen) only while all of them live 5% of the TTL longer (30 s
# of the default 10 minutes), so a lookup checks one per-model floor instead of every block's
# expiry, and the entries near their end are rebuilt at most once per margin (a scan of the
# model's frozen entries).
MAX_HOLDER_SETS = 65_536
# Distinct sets of locations holding a block that are numbered and kept (a few per replica in
# practice: the replicas and tiers a prefix reached); past it, new sets are not frozen.
SWEEP_MIN_ENTRIES = 64
# Expired entries the memory index removes per record, at least (and at least twice the blocks
# recorded): removal outpaces insertion, so without a capacity memory stays bounded by what was
# recorded within about one TTL, and a record's sweep costs the same order as the record.


class IndexUnavailable(Exception):
    """A shared index (Redis) could not answer; the caller should fall back to its local view."""


class Index(Protocol):
    async def lookup(self, model: str, hashes: Sequence[int]) -> BlockHits: ...

    async def record(self, model: str, hashes: Sequence[int], location: Location) -> None: ...

    async def evict(self, model: str, hashes: Sequence[int], location: Location) -> None: ...

    async def drop_location(self, location: Location) -> None: ...

    async def drop_replica(self, replica: str) -> None: ...

    async def close(self) -> None: ...


CapacityFn = Callable[[Location], int | None]
SpillFn = Callable[[Location], Location | None]


def no_capacity(_: Location) -> int | None:
    return None


def no_spill(_: Location) -> Location | None:
    return None


RemovedFn = Callable[[Location, int, str], None]


def ignore_removed(_location: Location, _blocks: int, _cause: str) -> None:
    return None


def spill_chain(location: Location, spill_to: SpillFn) -> list[Location]:
    """`location`, then where its pushed-out entries go, in order; ValueError on a cycle."""
    chain = [location]
    target = spill_to(location)
    while target is not None:
        if target in chain:
            path = " -> ".join(loc.key() for loc in [*chain, target])
            raise ValueError(f"spill_to has a cycle: {path}")
        chain.append(target)
        target = spill_to(target)
    return chain


BlockKey = int  # model number << 64 | block hash: one int, which the cyclic GC does not track
HASH_BITS = 64
HASH_MASK = (1 << HASH_BITS) - 1


class MemoryIndex:
    """In-process index for one gateway (the embedded default).

    Its tables hold only ints and floats (blocks are keyed by one int, locations and holder sets
    are numbered): CPython's cyclic GC then tracks none of their entries, and a full collection
    does not walk one object per block, a pause that grows with the index and that every request
    in flight would wait for (`python -m loadtest.bench.gc_pauses`, docs/bench/gc_pauses.md)."""

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        capacity_blocks: CapacityFn = no_capacity,
        spill_to: SpillFn = no_spill,
        clock: Callable[[], float] = time.monotonic,
        on_removed: RemovedFn = ignore_removed,
    ) -> None:
        """`on_removed(location, blocks, cause)` hears of entries leaving a location: cause
        "capacity" (live entries pushed out by its capacity; an HBM entry then spills on),
        "expired" (swept after its TTL), "evicted" (evict(): an engine's BlockRemoved),
        "dropped" (drop_location / drop_replica). It is called synchronously; it must not
        touch the index."""
        self._ttl_s = ttl_s
        self._freeze_margin_s = FREEZE_MARGIN * ttl_s
        self._capacity = capacity_blocks
        self._spill_to = spill_to
        self._clock = clock
        self._on_removed = on_removed
        self._models: dict[str, int] = {}  # model -> its number, the high bits of its BlockKeys
        self._model_names: list[str] = []
        self._location_ids: dict[Location, int] = {}
        self._locations: list[Location] = []
        # block -> {location id: expiry}
        self._blocks: dict[BlockKey, dict[int, float]] = {}
        # model -> hash -> the number of its holders' frozenset (self._sets), while none was
        # added or removed, and the earliest of their expiries when it was built (a refresh only
        # makes that conservative): a lookup then builds nothing and allocates nothing per block,
        # and blocks with the same holders share one set (what decide() groups into runs)
        self._frozen: dict[str, dict[int, int]] = {}
        self._frozen_expiry: dict[str, dict[int, float]] = {}
        # model -> the earliest expiry of its frozen entries (a lower bound: an entry unfrozen
        # since does not raise it); while it is in the future, every frozen entry is alive
        self._frozen_floor: dict[str, float] = {}
        self._sets: list[frozenset[Location]] = [frozenset()]  # number 0: never used (falsy)
        self._set_ids: dict[frozenset[Location], int] = {}
        # location -> LRU of its blocks, oldest first; with one TTL this is also expiry order
        self._lru: dict[Location, OrderedDict[BlockKey, None]] = {}

    async def lookup(self, model: str, hashes: Sequence[int]) -> BlockHits:
        return self.lookup_now(model, hashes)

    def lookup_now(self, model: str, hashes: Sequence[int]) -> BlockHits:
        now = self._clock()
        frozen = self._frozen.get(model)
        if frozen is not None:
            if self._frozen_floor[model] <= now:
                self._thaw(model, now)
            # the common case, at C speed: every block up to the first miss built (and so alive)
            built = cast(list[int], list(takewhile(truth, map(frozen.get, hashes))))
            hits: BlockHits = list(map(self._sets.__getitem__, built))
            if len(hits) == len(hashes) or self._key(model, hashes[len(hits)]) not in self._blocks:
                return hits
        return self._lookup_building(model, hashes, now)

    def _thaw(self, model: str, now: float) -> None:
        """Unfreeze the model's entries that end within the freeze margin (lookups rebuild them
        with their refreshed expiries), and raise the floor to the earliest left."""
        expiry = self._frozen_expiry[model]
        frozen = self._frozen[model]
        horizon = now + self._freeze_margin_s
        for h in [h for h, e in expiry.items() if e <= horizon]:
            del expiry[h], frozen[h]
        self._frozen_floor[model] = min(expiry.values(), default=float("inf"))

    def _lookup_building(self, model: str, hashes: Sequence[int], now: float) -> BlockHits:
        """lookup_now block by block, building (and keeping) each block's frozenset."""
        frozen = self._frozen.setdefault(model, {})
        frozen_expiry = self._frozen_expiry.setdefault(model, {})
        floor = self._frozen_floor.setdefault(model, float("inf"))
        horizon = now + self._freeze_margin_s
        base = self._model_base(model)
        locations = self._locations
        hits: BlockHits = []
        for h in hashes:
            holders = self._blocks.get(base | h)
            if not holders:
                break
            number = frozen.get(h)
            if number is not None:
                alive = self._sets[number]
            elif (earliest := min(holders.values())) > horizon:
                alive = frozenset(map(locations.__getitem__, holders))
                number = self._set_number(alive)
                if number is not None:
                    alive = self._sets[number]
                    frozen[h] = number
                    frozen_expiry[h] = earliest
                    floor = min(floor, earliest)
            else:
                alive = frozenset(locations[i] for i, expiry in holders.items() if expiry > now)
            if not alive:
                break
            hits.append(alive)
        self._frozen_floor[model] = floor
        return hits

    def _set_number(self, holders: frozenset[Location]) -> int | None:
        """The number of this holder set (one object per distinct set, shared by every block
        and prompt held by the same locations); None once MAX_HOLDER_SETS are numbered (the
        block is then looked up unfrozen)."""
        number = self._set_ids.get(holders)
        if number is None and len(self._sets) <= MAX_HOLDER_SETS:
            number = self._set_ids[holders] = len(self._sets)
            self._sets.append(holders)
        return number

    def _model_base(self, model: str) -> int:
        number = self._models.get(model)
        if number is None:
            number = self._models[model] = len(self._model_names)
            self._model_names.append(model)
        return number << HASH_BITS

    def _key(self, model: str, h: int) -> BlockKey:
        return self._model_base(model) | h

    def _location_id(self, location: Location) -> int:
        found = self._location_ids.get(location)
        if found is None:
            found = self._location_ids[location] = len(self._locations)
            self._locations.append(location)
        return found

    async def record(self, model: str, hashes: Sequence[int], location: Location) -> None:
        self.record_now(model, hashes, location)

    def record_now(self, model: str, hashes: Sequence[int], location: Location) -> None:
        if hashes and (min(hashes) < 0 or max(hashes) > HASH_MASK):
            raise ValueError("block hashes must be unsigned 64-bit integers (xxh3_64)")
        chain = spill_chain(location, self._spill_to)
        self.sweep(max(SWEEP_MIN_ENTRIES, 2 * len(hashes)))
        now = self._clock()
        base = self._model_base(model)
        moving = [base | h for h in hashes]
        for here in chain:
            moving = self._add(moving, here, now + self._ttl_s, now)
            if not moving:
                return

    def _add(
        self, keys: list[BlockKey], location: Location, expiry: float, now: float
    ) -> list[BlockKey]:
        """Record `keys` at `location`; return the live entries its capacity pushed out."""
        lru = self._lru.setdefault(location, OrderedDict())
        here = self._location_id(location)
        blocks = self._blocks
        for key in keys:
            holders = blocks.get(key)
            if holders is None:  # a block nobody held: it cannot be frozen, nothing to unfreeze
                holders = blocks[key] = {}
            elif here not in holders:
                self._unfreeze(key)
            holders[here] = expiry
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None  # a new key goes to the end already
        capacity = self._capacity(location)
        pushed_out: list[BlockKey] = []
        while capacity is not None and len(lru) > capacity:
            key, _ = lru.popitem(last=False)
            if self._forget(key, location) > now:
                pushed_out.append(key)
        if pushed_out:
            self._on_removed(location, len(pushed_out), "capacity")
        return pushed_out

    def sweep(self, max_entries: int) -> int:
        """Remove up to `max_entries` expired entries; return how many went.

        Each location's LRU is in expiry order, so only the head of each is looked at."""
        now = self._clock()
        removed = 0
        for location, lru in list(self._lru.items()):
            here, at = removed, self._location_id(location)
            while lru and removed < max_entries:
                key = next(iter(lru))
                if self._blocks.get(key, {}).get(at, now) > now:
                    break
                del lru[key]
                self._forget(key, location)
                removed += 1
            if removed > here:
                self._on_removed(location, removed - here, "expired")
            if not lru:
                del self._lru[location]
            if removed >= max_entries:
                break
        return removed

    def _forget(self, key: BlockKey, location: Location) -> float:
        """Remove one entry; return its expiry (0 if there was none)."""
        holders = self._blocks.get(key)
        at = self._location_ids.get(location)
        if holders is None or at is None:
            return 0.0
        expiry = holders.pop(at, 0.0)
        self._unfreeze(key)
        if not holders:
            del self._blocks[key]
        return expiry

    def _unfreeze(self, key: BlockKey) -> None:
        model = self._model_names[key >> HASH_BITS]
        frozen = self._frozen.get(model)
        h = key & HASH_MASK
        if frozen is not None and frozen.pop(h, None) is not None:
            del self._frozen_expiry[model][h]

    async def evict(self, model: str, hashes: Sequence[int], location: Location) -> None:
        lru = self._lru.get(location)
        base = self._model_base(model)
        gone = 0
        for h in hashes:
            key = base | h
            held = self._forget(key, location) > 0
            if lru is not None:
                lru.pop(key, None)
            gone += held
        if gone:
            self._on_removed(location, gone, "evicted")

    async def drop_location(self, location: Location) -> None:
        keys = self._lru.pop(location, OrderedDict())
        for key in keys:
            self._forget(key, location)
        if keys:
            self._on_removed(location, len(keys), "dropped")

    async def drop_replica(self, replica: str) -> None:
        for tier in (Tier.HBM, Tier.CPU):
            await self.drop_location(Location(replica, tier))

    async def close(self) -> None:
        return None

    def size(self, location: Location) -> int:
        return len(self._lru.get(location, ()))

    def entries(self) -> int:
        """(block, location) entries held, alive or expired and not yet swept."""
        return sum(len(holders) for holders in self._blocks.values())


async def record_prompt(index: Index, model: str, hashes: Sequence[int], where: Location) -> None:
    """Record a prompt's blocks at `where`, last block first, so its first block is the most
    recent: under the capacity bound a prompt's tail goes before its prefix, as in vLLM, which
    frees a request's blocks tail first (vllm/v1/core/single_type_kv_cache_manager.py, `free`)."""
    await index.record(model, hashes[::-1], where)
