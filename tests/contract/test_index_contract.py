"""The Index contract, run against every backend: memory, Redis, Redis Cluster (real servers)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from redis.asyncio import Connection, Redis
from redis.asyncio.cluster import RedisCluster

from gateway.index.redis_backend import IndexUnavailable, RedisIndex
from routing.index import Index, MemoryIndex
from routing.types import Location, Tier
from tests.helpers.ports import free_port
from tests.helpers.redis_server import RedisClusterProcs, RedisServer

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
A_HBM = Location("a", Tier.HBM)
A_CPU = Location("a", Tier.CPU)
B_HBM = Location("b", Tier.HBM)
B_CPU = Location("b", Tier.CPU)
REMOTE = Location("a", Tier.REMOTE)  # a remote tier that happens to share replica a's name
TTL_S = 0.3  # Redis: short enough to sleep past; long enough that a loaded CI box reads in time


def to_cpu(location: Location) -> Location | None:
    return Location(location.holder, Tier.CPU) if location.tier is Tier.HBM else None


def hbm_capacity(blocks: int) -> Callable[[Location], int | None]:
    return lambda loc: blocks if loc.tier is Tier.HBM else None


class IndexFactory:
    """Makes indexes of one backend, and lets time pass for them: the memory index reads an
    injected clock that `wait` moves (exact, no sleep); Redis expires keys on the server's own
    clock, so there `wait` sleeps."""

    def __init__(self, backend: str, request: pytest.FixtureRequest) -> None:
        self.backend = backend
        self._request = request
        self._prefix = f"t{uuid.uuid4().hex[:12]}"  # a fresh key space per test
        self._now = 0.0
        self.created: list[Index] = []

    def __call__(self, **options: Any) -> Index:
        index: Index
        if self.backend == "memory":
            index = MemoryIndex(clock=lambda: self._now, **options)
        else:
            cluster = self.backend == "redis_cluster"
            url = self._request.getfixturevalue("redis_cluster_url" if cluster else "redis_url")
            index = RedisIndex.from_url(url, cluster=cluster, key_prefix=self._prefix, **options)
        self.created.append(index)
        return index

    async def wait(self, seconds: float) -> None:
        if self.backend == "memory":
            self._now += seconds
        else:
            await asyncio.sleep(seconds)


@pytest.fixture(params=["memory", "redis", "redis_cluster"])
async def make_index(request: pytest.FixtureRequest) -> AsyncIterator[IndexFactory]:
    factory = IndexFactory(request.param, request)
    yield factory
    for index in factory.created:
        await index.close()


@pytest.fixture
def index(make_index: IndexFactory) -> Index:
    return make_index()


async def test_empty_index_holds_nothing(index: Index) -> None:
    assert await index.lookup(MODEL, []) == []
    assert await index.lookup(MODEL, [1, 2, 3]) == []


@dataclass(frozen=True)
class Case:
    records: list[tuple[list[int], Location]]
    query: list[int]
    expected: list[set[Location]]


LOOKUP_CASES = {
    "one location, whole prefix": Case([([1, 2, 3], A_HBM)], [1, 2, 3, 4], [{A_HBM}] * 3),
    "stops at first miss": Case(
        [([1, 2], A_HBM), ([4, 5], A_HBM)], [1, 2, 3, 4, 5], [{A_HBM}, {A_HBM}]
    ),
    "first block missing": Case([([2, 3], A_HBM)], [1, 2, 3], []),
    "two locations, different lengths": Case(
        [([1, 2, 3], A_HBM), ([1], B_HBM)], [1, 2, 3], [{A_HBM, B_HBM}, {A_HBM}, {A_HBM}]
    ),
    "shorter holder ends, longer continues": Case(
        [([1], A_HBM), ([1, 2], B_CPU), ([1, 2, 3], REMOTE)],
        [1, 2, 3],
        [{A_HBM, B_CPU, REMOTE}, {B_CPU, REMOTE}, {REMOTE}],
    ),
    "extreme hash values": Case([([0, 2**64 - 1], A_HBM)], [0, 2**64 - 1], [{A_HBM}] * 2),
}


@pytest.mark.parametrize("case", LOOKUP_CASES.values(), ids=LOOKUP_CASES.keys())
async def test_lookup_returns_leading_blocks_per_location(index: Index, case: Case) -> None:
    for hashes, location in case.records:
        await index.record(MODEL, hashes, location)
    assert await index.lookup(MODEL, case.query) == [frozenset(s) for s in case.expected]


async def test_entries_expire_after_ttl_unless_refreshed(make_index: IndexFactory) -> None:
    index = make_index(ttl_s=TTL_S)
    await index.record(MODEL, [1, 2], A_HBM)
    await index.record(MODEL, [1], B_HBM)
    assert await index.lookup(MODEL, [1, 2]) == [{A_HBM, B_HBM}, {A_HBM}]
    await make_index.wait(TTL_S * 0.6)
    await index.record(MODEL, [1], B_HBM)  # refreshes B's entry only
    await make_index.wait(TTL_S * 0.6)
    assert await index.lookup(MODEL, [1, 2]) == [{B_HBM}]
    await make_index.wait(TTL_S * 0.6)
    assert await index.lookup(MODEL, [1, 2]) == []


async def test_a_refreshed_prefix_stays_whole_past_its_first_ttl(make_index: IndexFactory) -> None:
    """A lookup in between (the memory index keeps what it built) does not hide the refresh."""
    index = make_index(ttl_s=TTL_S)
    await index.record(MODEL, [1, 2, 3], A_HBM)
    await index.record(MODEL, [1], B_HBM)
    assert await index.lookup(MODEL, [1, 2, 3]) == [{A_HBM, B_HBM}, {A_HBM}, {A_HBM}]
    await make_index.wait(TTL_S * 0.6)
    await index.record(MODEL, [1, 2, 3], A_HBM)
    await make_index.wait(TTL_S * 0.6)
    assert await index.lookup(MODEL, [1, 2, 3]) == [{A_HBM}, {A_HBM}, {A_HBM}]
    assert await index.lookup(MODEL, [1, 2, 3]) == [{A_HBM}, {A_HBM}, {A_HBM}]


async def test_capacity_pushes_out_least_recently_recorded_to_cpu(
    make_index: IndexFactory,
) -> None:
    index = make_index(capacity_blocks=hbm_capacity(3), spill_to=to_cpu)
    await index.record(MODEL, [1, 2, 3], A_HBM)
    await index.record(MODEL, [1], A_HBM)  # 1 becomes most recent; 2 is now the oldest
    await index.record(MODEL, [4], A_HBM)
    assert await index.lookup(MODEL, [1, 2, 3, 4]) == [{A_HBM}, {A_CPU}, {A_HBM}, {A_HBM}]


async def test_one_record_larger_than_capacity_keeps_its_tail(make_index: IndexFactory) -> None:
    index = make_index(capacity_blocks=hbm_capacity(3), spill_to=to_cpu)
    await index.record(MODEL, [1, 2, 3, 4, 5], A_HBM)
    assert await index.lookup(MODEL, [1, 2, 3, 4, 5]) == [{A_CPU}] * 2 + [{A_HBM}] * 3


async def test_spill_cascades_and_ends_where_nothing_takes_it(make_index: IndexFactory) -> None:
    index = make_index(capacity_blocks=lambda _: 2, spill_to=to_cpu)
    await index.record(MODEL, [1, 2, 3, 4, 5, 6], A_HBM)
    assert await index.lookup(MODEL, [1]) == []
    assert await index.lookup(MODEL, [3, 4, 5, 6]) == [{A_CPU}] * 2 + [{A_HBM}] * 2


async def test_capacity_counts_blocks_of_every_model(make_index: IndexFactory) -> None:
    index = make_index(capacity_blocks=hbm_capacity(2), spill_to=to_cpu)
    await index.record("m1", [1, 2], A_HBM)
    await index.record("m2", [1], A_HBM)
    assert await index.lookup("m1", [1, 2]) == [{A_CPU}, {A_HBM}]
    assert await index.lookup("m2", [1]) == [{A_HBM}]


async def test_evict_removes_one_location_and_frees_capacity(make_index: IndexFactory) -> None:
    index = make_index(capacity_blocks=hbm_capacity(3), spill_to=to_cpu)
    await index.record(MODEL, [1, 2, 3], A_HBM)
    await index.record(MODEL, [1, 2, 3], B_HBM)
    await index.evict(MODEL, [2], A_HBM)
    assert await index.lookup(MODEL, [1, 2, 3]) == [{A_HBM, B_HBM}, {B_HBM}, {A_HBM, B_HBM}]
    await index.record(MODEL, [4], A_HBM)  # fits in the freed slot: nothing spills
    assert await index.lookup(MODEL, [1, 3, 4]) == [{A_HBM, B_HBM}, {A_HBM, B_HBM}, {A_HBM}]
    await index.evict(MODEL, [9], A_HBM)  # evicting what is not held is a no-op


async def test_drop_location_forgets_it_and_frees_capacity(make_index: IndexFactory) -> None:
    index = make_index(capacity_blocks=hbm_capacity(2), spill_to=to_cpu)
    await index.record(MODEL, [1, 2], A_HBM)
    await index.record(MODEL, [1], B_HBM)
    await index.drop_location(A_HBM)
    assert await index.lookup(MODEL, [1, 2]) == [{B_HBM}]
    await index.record(MODEL, [3, 4], A_HBM)
    assert await index.lookup(MODEL, [3, 4]) == [{A_HBM}, {A_HBM}]
    await index.drop_location(Location("never-seen", Tier.HBM))


async def test_drop_replica_forgets_its_hbm_and_cpu_only(index: Index) -> None:
    for location in (A_HBM, A_CPU, B_HBM, REMOTE):
        await index.record(MODEL, [1, 2], location)
    await index.drop_replica("a")
    assert await index.lookup(MODEL, [1, 2]) == [{B_HBM, REMOTE}] * 2


async def test_expired_entry_pushed_out_does_not_come_back_as_cpu_hit(
    make_index: IndexFactory,
) -> None:
    index = make_index(ttl_s=TTL_S, capacity_blocks=hbm_capacity(2), spill_to=to_cpu)
    await index.record(MODEL, [1, 2], A_HBM)
    await make_index.wait(TTL_S * 1.2)
    await index.record(MODEL, [3, 4], A_HBM)  # pushes 1 and 2 out of HBM, expired
    assert await index.lookup(MODEL, [1, 2]) == []
    assert await index.lookup(MODEL, [3, 4]) == [{A_HBM}] * 2


def swap_tiers(location: Location) -> Location | None:
    other = Tier.CPU if location.tier is Tier.HBM else Tier.HBM
    return Location(location.holder, other)


SPILL_CYCLES = {
    "hbm <-> cpu": swap_tiers,
    "onto itself": lambda location: location,
}


@pytest.mark.parametrize("spill_to", SPILL_CYCLES.values(), ids=SPILL_CYCLES.keys())
async def test_spill_cycle_is_rejected_before_writing(
    make_index: IndexFactory, spill_to: Callable[[Location], Location | None]
) -> None:
    index = make_index(capacity_blocks=lambda _: 1, spill_to=spill_to)
    with pytest.raises(ValueError, match="cycle"):
        await index.record(MODEL, [1, 2, 3], A_HBM)
    assert await index.lookup(MODEL, [1]) == []


MODEL_PAIRS = {
    "different names": ("m1", "m2"),
    "separator in name": ("m", "m:1"),
    "hash tag in name": ("{m}", "m"),
    "case": ("Llama", "llama"),
    "unicode": ("modèle", "modele"),
}


@pytest.mark.parametrize("pair", MODEL_PAIRS.values(), ids=MODEL_PAIRS.keys())
async def test_models_are_isolated(index: Index, pair: tuple[str, str]) -> None:
    first, second = pair
    await index.record(first, [1, 2], A_HBM)
    assert await index.lookup(second, [1, 2]) == []
    await index.record(second, [1], B_HBM)  # the same hash under another model
    assert await index.lookup(first, [1, 2]) == [{A_HBM}, {A_HBM}]
    assert await index.lookup(second, [1, 2]) == [{B_HBM}]
    await index.evict(second, [1], A_HBM)  # A holds 1 only under `first`
    assert await index.lookup(first, [1]) == [{A_HBM}]


# Memory only


async def test_memory_index_without_capacity_sweeps_expired_entries() -> None:
    now = [0.0]
    index = MemoryIndex(ttl_s=10.0, clock=lambda: now[0])
    for start in range(0, 1000, 100):
        await index.record(MODEL, range(start, start + 100), A_HBM)
    assert index.entries() == 1000
    now[0] = 11.0  # every entry has expired
    for i in range(10):  # each record sweeps at least 64 expired entries
        await index.record(MODEL, [10_000 + i], B_HBM)
    assert index.entries() <= 1000 - 10 * 64 + 10
    for i in range(100):
        await index.record(MODEL, [20_000 + i], B_HBM)
    assert index.entries() == 110  # only B's live entries are left
    assert await index.lookup(MODEL, [10_000]) == [{B_HBM}]


# Redis only


@pytest.mark.parametrize("cluster", [False, True], ids=["redis", "redis_cluster"])
async def test_lookup_is_one_round_trip(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, cluster: bool
) -> None:
    """Count socket writes on the real connections: a pipelined round trip is one write per node."""
    url = request.getfixturevalue("redis_cluster_url" if cluster else "redis_url")
    index = RedisIndex.from_url(url, cluster=cluster, key_prefix=f"t{uuid.uuid4().hex[:12]}")
    hashes = list(range(512))
    await index.record(MODEL, hashes[:300], A_HBM)
    await index.lookup(MODEL, hashes)  # warm up: connections, cluster slot map
    writes: list[Connection] = []
    send = Connection.send_packed_command

    async def counting_send(self: Connection, command: Any, check_health: bool = True) -> None:
        writes.append(self)
        await send(self, command, check_health)

    monkeypatch.setattr(Connection, "send_packed_command", counting_send)
    hits = await index.lookup(MODEL, hashes)
    monkeypatch.undo()
    assert len(hits) == 300
    # A cluster pipeline writes once to each node its keys live on, concurrently (3 masters).
    assert len(writes) == (3 if cluster else 1)
    assert len(set(map(id, writes))) == len(writes)
    await index.close()


# the cluster case starts (and stops) a 3-master cluster of its own: `make check` leaves it out
STOPPED_CASES = [False, pytest.param(True, marks=pytest.mark.slow)]


@pytest.mark.parametrize("cluster", STOPPED_CASES, ids=["redis", "redis_cluster"])
async def test_stopped_redis_raises_index_unavailable_quickly(cluster: bool) -> None:
    servers = RedisClusterProcs() if cluster else RedisServer()
    servers.start()
    index = RedisIndex.from_url(servers.url, cluster=cluster, socket_timeout_s=0.25)
    try:
        await index.record(MODEL, [1, 2, 3], A_HBM)
        servers.stop()
        calls = [
            index.lookup(MODEL, [1, 2, 3]),
            index.record(MODEL, [1], A_HBM),
            index.evict(MODEL, [1], A_HBM),
            index.drop_replica("a"),
        ]
        for call in calls:
            started_s = time.monotonic()
            with pytest.raises(IndexUnavailable):
                await call
            assert time.monotonic() - started_s < 1.0
    finally:
        servers.stop()
        await index.close()


@pytest.mark.parametrize("cluster", [False, True], ids=["redis", "redis_cluster"])
async def test_unreachable_redis_raises_index_unavailable(cluster: bool) -> None:
    index = RedisIndex.from_url(f"redis://127.0.0.1:{free_port()}/0", cluster=cluster)
    with pytest.raises(IndexUnavailable):
        await index.lookup(MODEL, [1])
    await index.close()


async def test_stalled_redis_times_out_as_index_unavailable(redis_url: str) -> None:
    index = RedisIndex.from_url(redis_url, socket_timeout_s=0.1, key_prefix=uuid.uuid4().hex)
    admin = Redis.from_url(redis_url)
    try:
        await index.record(MODEL, [1], A_HBM)
        await admin.client_pause(500, all=True)  # the server stops answering for 0.5 s
        started_s = time.monotonic()
        with pytest.raises(IndexUnavailable):
            await index.lookup(MODEL, [1])
        assert time.monotonic() - started_s < 0.4
        await asyncio.sleep(0.5)
        assert await index.lookup(MODEL, [1]) == [{A_HBM}]  # reconnects once Redis answers
    finally:
        await admin.aclose()
        await index.close()


def test_key_prefix_must_not_carry_a_hash_tag() -> None:
    with pytest.raises(ValueError, match="hash tag"):
        RedisIndex(Redis(), key_prefix="{cl}")


@pytest.mark.parametrize("cluster", [False, True], ids=["redis", "redis_cluster"])
async def test_scripts_are_reloaded_after_redis_forgets_them(
    request: pytest.FixtureRequest, cluster: bool
) -> None:
    """A restarted Redis has an empty script cache: the index reloads its scripts and goes on."""
    url = request.getfixturevalue("redis_cluster_url" if cluster else "redis_url")
    index = RedisIndex.from_url(url, cluster=cluster, key_prefix=f"t{uuid.uuid4().hex[:12]}")
    admin: Any = RedisCluster.from_url(url) if cluster else Redis.from_url(url)
    try:
        await index.record(MODEL, [1, 2], A_HBM)
        await admin.script_flush()
        await index.record(MODEL, [2, 3], B_HBM)
        await index.evict(MODEL, [1], A_HBM)
        assert await index.lookup(MODEL, [1, 2, 3]) == []
        assert await index.lookup(MODEL, [2, 3]) == [{A_HBM, B_HBM}, {B_HBM}]
    finally:
        await admin.aclose()
        await index.close()


async def test_a_block_value_keeps_only_live_holders(redis_url: str) -> None:
    """Bounded memory: a holder whose entry expired is dropped when another holder is added."""
    prefix = f"t{uuid.uuid4().hex[:12]}"
    index = RedisIndex.from_url(redis_url, ttl_s=TTL_S, key_prefix=prefix)
    admin = Redis.from_url(redis_url)
    try:
        await index.record(MODEL, [1], A_HBM)
        await asyncio.sleep(TTL_S * 0.6)
        await index.record(MODEL, [1], B_HBM)
        await asyncio.sleep(TTL_S * 0.6)  # A's entry has expired, B's has not
        await index.record(MODEL, [1], A_CPU)
        keys = [key async for key in admin.scan_iter(f"{prefix}:b:*")]
        assert len(keys) == 1
        value = await admin.get(keys[0])
        assert isinstance(value, bytes)
        assert value.count(b"\n") == 2 and b"hbm:a " not in value
    finally:
        await admin.aclose()
        await index.close()
