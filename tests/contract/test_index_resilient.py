"""ResilientIndex over a real redis-server that the test stops and restarts on the same port."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from gateway.index.redis_backend import RedisIndex
from gateway.index.resilient import ResilientIndex
from routing.index import MemoryIndex
from routing.types import Location, Tier
from tests.helpers.redis_server import RedisServer

MODEL = "m"
A = Location("a", Tier.HBM)
B = Location("b", Tier.HBM)
RETRY_AFTER_S = 0.05
RECOVERY_POLLS = 200  # x RETRY_AFTER_S


def resilient(url: str, errors: list[str]) -> ResilientIndex:
    return ResilientIndex(
        RedisIndex.from_url(url),
        MemoryIndex(),
        retry_after_s=RETRY_AFTER_S,
        on_error=lambda op, _err: errors.append(op),
    )


async def until_recovered(index: ResilientIndex) -> None:
    for _ in range(RECOVERY_POLLS):
        await index.lookup(MODEL, [1])  # a lookup while degraded may start a probe
        if not index.degraded:
            return
        await asyncio.sleep(RETRY_AFTER_S)
    raise AssertionError("the index did not recover")


async def test_serves_locally_while_redis_is_down_and_replays_on_recovery() -> None:
    server = RedisServer().start()
    errors: list[str] = []
    index = resilient(server.url, errors)
    other = RedisIndex.from_url(server.url)  # another gateway's view of the same Redis
    try:
        await index.record(MODEL, [1, 2], A)
        await other.record(MODEL, [1, 2, 3], B)
        assert await index.lookup(MODEL, [1, 2, 3]) == [{A, B}, {A, B}, {B}]  # the shared view
        assert not index.degraded and index.since is None

        server.stop()
        assert await index.lookup(MODEL, [1, 2, 3]) == [{A}, {A}]  # the local view
        assert index.degraded and index.since is not None
        assert errors == ["lookup"]
        await index.record(MODEL, [1, 2, 3], A)
        await index.drop_replica("b")  # e.g. b restarted during the outage
        assert await index.lookup(MODEL, [1, 2, 3]) == [{A}] * 3
        assert errors == ["lookup"]  # while degraded, writes stay local: no call, no error

        server.start()  # empty again, on the same port
        await until_recovered(index)
        assert index.since is None
        # The outage's writes were replayed into the empty Redis: other gateways see them.
        await other.close()
        other = RedisIndex.from_url(server.url)  # its pooled connection died with the server
        assert await other.lookup(MODEL, [1, 2, 3]) == [{A}] * 3
        assert await index.lookup(MODEL, [1, 2, 3]) == [{A}] * 3
    finally:
        await index.close()
        await other.close()
        server.stop()


async def test_a_stalled_redis_degrades_instead_of_holding_lookups() -> None:
    server = RedisServer().start()
    index = resilient(server.url, [])
    admin = Redis.from_url(server.url)
    try:
        await index.record(MODEL, [1], A)
        await admin.client_pause(1000, all=True)  # Redis stops answering for 1 s
        assert await index.lookup(MODEL, [1]) == [{A}]  # from the local view, after the deadline
        assert index.degraded
        await until_recovered(index)
    finally:
        await admin.aclose()
        await index.close()
        server.stop()
