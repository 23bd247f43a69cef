"""The KV index in Redis, shared by several gateway instances (same contract as MemoryIndex).

Layout (every command touches one key, so it works unchanged on Redis Cluster):

  <prefix>:b:<model>:<hash>   hash; field = Location.key(), value = expiry (epoch ms). The key's
                              own TTL is the full TTL, refreshed by every record, so it outlives
                              its longest-lived field; lookup drops fields already past expiry.
                              (Redis 7.0 has no per-field HEXPIRE.)
  <prefix>:lru:<location>     sorted set per location; member = "<model>:<hash>", score = recency
                              (epoch microseconds, strictly increasing per process). Trimmed to
                              the location's capacity by a one-key Lua script that pops the
                              oldest members; those move to `spill_to(location)`, if any.

<model> is the model name in URL-safe base64 without padding and <hash> is hex, so no model name
can forge a separator, a hash tag ("{...}") or another model's key; <location> is base64 too.
No hash tags are used: blocks spread over all slots.

`lookup` is one pipelined round trip (one HGETALL per block, transaction=False) cut at the first
miss in Python. `record` is one round trip, plus one per spill step when a location overflows.
Expiry compares gateway wall clocks, so gateways sharing an index need synchronised clocks (NTP)
and the same ttl_s. Every Redis failure surfaces as IndexUnavailable.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError

from routing.index import DEFAULT_TTL_S, CapacityFn, SpillFn, _no_capacity, _no_spill
from routing.types import BlockHits, Location, Tier

DEFAULT_SOCKET_TIMEOUT_S = 0.25
# Applies to each socket read, not to a whole lookup. Redis answers a pipelined lookup in ~1-3 ms
# on a LAN (server time, 2048 HGETALLs); a 250 ms silence means Redis is in trouble, and the
# gateway is better off routing on its local view than waiting longer.
DEFAULT_KEY_PREFIX = "cl"
HOLDER_SET_CACHE_SIZE = 4096  # parsed holder sets kept (~1 MB at 16 holders); cleared when full
DROP_BATCH_BLOCKS = 1024  # members popped per round trip by drop_location: ~50 kB replies

# Trim one location's LRU: drop members whose recency is older than the TTL (their entries have
# expired), then pop the oldest members beyond capacity and return them, oldest first.
# KEYS[1] = LRU sorted set; ARGV = capacity in blocks (-1: unbounded), expired-before score, ttl ms.
_TRIM_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
local capacity = tonumber(ARGV[1])
if capacity < 0 then return {} end
local over = redis.call('ZCARD', KEYS[1]) - capacity
if over <= 0 then return {} end
local popped = redis.call('ZPOPMIN', KEYS[1], over)
local members = {}
for i = 1, #popped, 2 do members[#members + 1] = popped[i] end
return members
"""

RedisClient = Redis | RedisCluster


class IndexUnavailable(Exception):
    """Redis could not answer; the caller should fall back to its local view."""


@contextmanager
def _mapped_errors() -> Iterator[None]:
    try:
        yield
    except (RedisError, RedisClusterException) as e:
        raise IndexUnavailable(f"{type(e).__name__}: {e}") from e


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


class RedisIndex:
    """KV index in Redis or Redis Cluster; see the module docstring for the key layout."""

    def __init__(
        self,
        client: RedisClient,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        capacity_blocks: CapacityFn = _no_capacity,
        spill_to: SpillFn = _no_spill,
        key_prefix: str = DEFAULT_KEY_PREFIX,
    ) -> None:
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError(f"key_prefix {key_prefix!r} must not contain a hash tag")
        self._redis = client
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._capacity = capacity_blocks
        self._spill_to = spill_to
        self._prefix = key_prefix
        self._last_recency_us = 0
        self._holder_sets: dict[tuple[bytes, ...], frozenset[Location]] = {}

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        cluster: bool = False,
        ttl_s: float = DEFAULT_TTL_S,
        capacity_blocks: CapacityFn = _no_capacity,
        spill_to: SpillFn = _no_spill,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
    ) -> RedisIndex:
        # No retries: a failed call should reach the gateway's fallback at once, not after backoff.
        options: dict[str, Any] = {
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": socket_timeout_s,
            "retry": Retry(NoBackoff(), 0),
        }
        client: RedisClient
        if cluster:
            client = RedisCluster.from_url(url, **options)
        else:
            client = Redis.from_url(url, **options)
        return cls(
            client,
            ttl_s=ttl_s,
            capacity_blocks=capacity_blocks,
            spill_to=spill_to,
            key_prefix=key_prefix,
        )

    # keys

    def _member(self, model: str, h: int) -> str:
        return f"{_b64(model)}:{h:x}"

    def _block_key(self, member: str) -> str:
        return f"{self._prefix}:b:{member}"

    def _lru_key(self, location: Location) -> str:
        return f"{self._prefix}:lru:{_b64(location.key())}"

    # the Index protocol

    async def lookup(self, model: str, hashes: Sequence[int]) -> BlockHits:
        if not hashes:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for h in hashes:
            pipe.hgetall(self._block_key(self._member(model, h)))
        with _mapped_errors():
            replies: list[dict[bytes, bytes]] = await pipe.execute()
        now_ms = time.time() * 1000
        hits: BlockHits = []
        for fields in replies:
            alive = tuple(field for field, expiry_ms in fields.items() if int(expiry_ms) > now_ms)
            if not alive:
                break
            hits.append(self._holders(alive))
        return hits

    def _holders(self, fields: tuple[bytes, ...]) -> frozenset[Location]:
        # Parsing fields into Locations was half the Python time of a lookup (16 holders x 2048
        # blocks); the distinct holder sets are few (a shared prefix's blocks have the same ones).
        holders = self._holder_sets.get(fields)
        if holders is None:
            if len(self._holder_sets) >= HOLDER_SET_CACHE_SIZE:
                self._holder_sets.clear()
            holders = frozenset(Location.parse(field.decode()) for field in fields)
            self._holder_sets[fields] = holders
        return holders

    async def record(self, model: str, hashes: Sequence[int], location: Location) -> None:
        members = [self._member(model, h) for h in hashes]
        target: Location | None = location
        pushed_out: list[str] = []
        pushed_from = location
        # Each pass writes `members` into `target` and deletes the previous pass's pushed-out
        # entries from their location; what `target` pushes out moves on to its spill tier.
        while members or pushed_out:
            pipe = self._redis.pipeline(transaction=False)
            for member in pushed_out:
                pipe.hdel(self._block_key(member), pushed_from.key())
            if target is not None and members:
                self._queue_add(pipe, members, target)
            with _mapped_errors():
                replies = await pipe.execute()
            if target is None or not members:
                return
            popped: list[bytes] = replies[-1]
            pushed_out = [member.decode() for member in popped]
            pushed_from = target
            target = self._spill_to(target)
            members = pushed_out if target is not None else []

    def _queue_add(self, pipe: Any, members: list[str], location: Location) -> None:
        now_us = time.time_ns() // 1000
        expiry_ms = now_us // 1000 + self._ttl_ms
        first_us = max(now_us, self._last_recency_us + 1)
        self._last_recency_us = first_us + len(members) - 1
        field = location.key()
        recency: dict[str, int] = {}
        for i, member in enumerate(members):
            key = self._block_key(member)
            pipe.hset(key, field, expiry_ms)
            pipe.pexpire(key, self._ttl_ms)
            recency[member] = first_us + i  # a repeated hash keeps its latest position, as in LRU
        lru = self._lru_key(location)
        pipe.zadd(lru, recency)
        capacity = self._capacity(location)
        expired_before_us = now_us - self._ttl_ms * 1000
        args = (-1 if capacity is None else capacity, expired_before_us, self._ttl_ms)
        pipe.eval(_TRIM_LUA, 1, lru, *args)

    async def evict(self, model: str, hashes: Sequence[int], location: Location) -> None:
        if not hashes:
            return
        members = [self._member(model, h) for h in hashes]
        pipe = self._redis.pipeline(transaction=False)
        for member in members:
            pipe.hdel(self._block_key(member), location.key())
        pipe.zrem(self._lru_key(location), *members)
        with _mapped_errors():
            await pipe.execute()

    async def drop_location(self, location: Location) -> None:
        lru = self._lru_key(location)
        with _mapped_errors():
            while True:
                popped: list[Any] = await self._redis.zpopmin(lru, DROP_BATCH_BLOCKS)
                if not popped:
                    return
                pipe = self._redis.pipeline(transaction=False)
                for member, _ in popped:
                    pipe.hdel(self._block_key(member.decode()), location.key())
                await pipe.execute()
                if len(popped) < DROP_BATCH_BLOCKS:
                    return

    async def drop_replica(self, replica: str) -> None:
        for tier in (Tier.HBM, Tier.CPU):
            await self.drop_location(Location(replica, tier))

    async def close(self) -> None:
        with _mapped_errors():
            await self._redis.aclose()
