"""A small key-value with a time to live, next to the block index: in memory for one gateway,
in Redis for every gateway sharing the index (the response id -> replica map of
gateway/serving/responses.py lives here).

The contract (tests/contract/test_keyvalue_contract.py runs it against both backends):
- `put(key, value, ttl_s)` stores `value` under `key` for `ttl_s` seconds, replacing what was
  there; `get(key)` is the value, or None once it expired, was deleted or never was;
  `delete(key)` forgets it (a missing key is no error).
- A backend bounds its memory (MemoryKeyValue: `max_entries`, the least recently written
  dropped first; Redis: its own maxmemory policy).
- The Redis backend raises what the client raises when Redis fails: the caller decides what a
  failure means (gateway/serving/responses.py keeps a local copy and serves from it).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

MAX_ENTRIES = 100_000
# At most this many keys in one gateway's memory: a response id and a replica name are ~100
# bytes with the dict's overhead, ~10 MB at most.


class KeyValue(Protocol):
    async def put(self, key: str, value: str, ttl_s: float) -> None: ...

    async def get(self, key: str) -> str | None: ...

    async def delete(self, key: str) -> None: ...


class MemoryKeyValue:
    """The key-value in this process; `clock` is an argument so tests move time."""

    def __init__(
        self, max_entries: int = MAX_ENTRIES, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> value, expiry

    def put_now(self, key: str, value: str, ttl_s: float) -> None:
        self._entries[key] = (value, self._clock() + ttl_s)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def get_now(self, key: str) -> str | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        value, expires_s = entry
        if self._clock() >= expires_s:
            del self._entries[key]
            return None
        return value

    async def put(self, key: str, value: str, ttl_s: float) -> None:
        self.put_now(key, value, ttl_s)

    async def get(self, key: str) -> str | None:
        return self.get_now(key)

    async def delete(self, key: str) -> None:
        self._entries.pop(key, None)


class RedisKeyValue:
    """The key-value in Redis (a plain string key per entry, with PX): shared by every gateway
    on the same Redis or Redis Cluster (each key is its own slot)."""

    def __init__(self, redis: Any, prefix: str) -> None:
        self._redis = redis
        self._prefix = prefix

    def _key(self, key: str) -> str:
        return f"{self._prefix}:{key}"

    async def put(self, key: str, value: str, ttl_s: float) -> None:
        await self._redis.set(self._key(key), value, px=max(1, round(ttl_s * 1000)))

    async def get(self, key: str) -> str | None:
        value = await self._redis.get(self._key(key))
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)

    async def delete(self, key: str) -> None:
        await self._redis.delete(self._key(key))
