"""The KeyValue contract (gateway/index/keyvalue.py), run against the memory backend and a real
throwaway redis-server."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from gateway.index.keyvalue import KeyValue, MemoryKeyValue, RedisKeyValue

TTL_S = 0.3  # Redis: short enough to sleep past; long enough that a loaded box reads in time


class Store:
    """A backend and a way to let time pass for it: the memory one reads a clock `wait` moves;
    Redis expires keys on its own clock, so there `wait` sleeps."""

    def __init__(self, kv: KeyValue, now: list[float] | None) -> None:
        self.kv = kv
        self._now = now

    async def wait(self, seconds: float) -> None:
        if self._now is not None:
            self._now[0] += seconds
        else:
            await asyncio.sleep(seconds)


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        now = [0.0]
        yield Store(MemoryKeyValue(max_entries=3, clock=lambda: now[0]), now)
        return
    redis = Redis.from_url(request.getfixturevalue("redis_url"))
    try:
        yield Store(RedisKeyValue(redis, f"t{uuid.uuid4().hex[:12]}"), None)
    finally:
        await redis.aclose()


async def test_a_value_is_read_back_until_it_expires(store: Store) -> None:
    await store.kv.put("resp_1", "replica-a", TTL_S)
    assert await store.kv.get("resp_1") == "replica-a"
    await store.wait(TTL_S + 0.2)
    assert await store.kv.get("resp_1") is None


async def test_put_replaces_the_value_and_its_ttl(store: Store) -> None:
    await store.kv.put("resp_1", "replica-a", TTL_S)
    await store.kv.put("resp_1", "replica-b", 60.0)
    await store.wait(TTL_S + 0.2)
    assert await store.kv.get("resp_1") == "replica-b"


async def test_delete_forgets_and_a_missing_key_is_none(store: Store) -> None:
    assert await store.kv.get("never") is None
    await store.kv.delete("never")  # no error
    await store.kv.put("resp_1", "replica-a", 60.0)
    await store.kv.put("resp_2", "replica-b", 60.0)
    await store.kv.delete("resp_1")
    assert await store.kv.get("resp_1") is None
    assert await store.kv.get("resp_2") == "replica-b"


async def test_memory_keeps_at_most_max_entries_dropping_the_oldest() -> None:
    kv = MemoryKeyValue(max_entries=2)
    for i in range(3):
        await kv.put(f"resp_{i}", "a", 60.0)
    assert [await kv.get(f"resp_{i}") for i in range(3)] == [None, "a", "a"]
