"""The KV index in Redis, shared by several gateway instances (same contract as MemoryIndex).

Layout (Redis >= 7.0; every command and script touches keys of one slot, so it works unchanged on
Redis Cluster):

  <prefix>:b:{<bucket>}:<model>:<hash>
      string: the block's holder set, one entry per location, "\\n<location> <expiry ms>" each
      (e.g. "\\nhbm:10.0.0.5:8000 1718000000000"). The key expires with its longest-lived entry
      (PXAT); lookup ignores entries already past their expiry. Written only by the one Lua
      script below, which refreshes or adds one location's entry (or removes it) in place.
  <prefix>:lru:<location>
      sorted set per location: member "<model>:<hash>", score = recency (epoch microseconds,
      strictly increasing per process). A Lua script adds members, drops those older than the
      TTL and pops the oldest beyond the location's capacity; popped entries move to
      `spill_to(location)`, if any.

<bucket> is the block hash modulo KEY_BUCKETS, as a Redis hash tag: a lookup or record groups its
blocks by bucket into one MGET / one script call per bucket instead of one command per block (on
a single server the lookup is a single MGET). <model> is the model name in URL-safe base64 without
padding and <hash> is hex, so no model name can forge a separator, a hash tag or another model's
key; <location> in the LRU key is base64 too.

Why one string per block: redis-py's cost is per command and per reply object (~50 us per
pipelined command in `python -m loadtest.bench.index`, docs/index-bench.md), and a HGETALL reply
costs two Python objects per holder; one MGET of compact strings is one command. The
distinct holder sets of a prompt are few (a shared prefix's blocks were recorded together), so
parsed sets are cached by the raw value.

`lookup` is one round trip (one MGET, or one pipelined MGET per bucket on a cluster: one write per
node), cut at the first miss in Python: blocks past a miss are mostly absent keys (a nil reply is
5 bytes), far cheaper than the second round trip that fetching in growing batches would cost in
the common case of a long hit. `record` is one round trip, plus one per spill step when a
location overflows. Expiry compares gateway wall clocks, so gateways sharing an index need
synchronised clocks (NTP) and the same ttl_s. Every Redis failure surfaces as IndexUnavailable.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, TypedDict, Unpack

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from routing.index import (
    DEFAULT_TTL_S,
    CapacityFn,
    IndexUnavailable,
    SpillFn,
    no_capacity,
    no_spill,
    spill_chain,
)
from routing.types import BlockHits, Location, Tier

__all__ = ["IndexUnavailable", "RedisIndex"]

DEFAULT_SOCKET_TIMEOUT_S = 0.25
# Applies to each socket read, not to a whole lookup. Redis answers a 512-block MGET in well under
# 1 ms of server time; a 250 ms silence means Redis is in trouble, and the gateway is better off
# routing on its local view than waiting longer.
DEFAULT_KEY_PREFIX = "cl"
KEY_BUCKETS = 64
# Hash-tag buckets: a lookup sends one MGET per bucket it touches (~all 64 for a long prompt),
# and the keys spread over 64 slots, ~21 per master on a 3-master cluster. Fewer buckets is fewer
# commands (16: ~1 ms less per 8k-token lookup in loadtest/bench/index.py) but coarser balance on
# larger clusters; keep it >= 8x the masters. Every gateway sharing an index must use the same
# value (it is in the keys).
HOLDER_SET_CACHE_SIZE = 4096  # parsed holder sets kept (~1 MB at 16 holders); cleared when full
DROP_BATCH_BLOCKS = 1024  # members popped per round trip by drop_location: ~50 kB replies

# Set (ARGV[2] = expiry ms) or remove (ARGV[2] = "") one location's entry in each block key.
# KEYS = block keys of one slot; ARGV[1] = location key (no spaces or newlines); ARGV[3] = now ms.
# A refresh rewrites the entry in place; adding a new holder also drops expired entries, so a
# value never grows past one entry per live location.
_HOLDER_LUA = """
local needle = '\\n' .. ARGV[1] .. ' '
local expiry = ARGV[2]
local now = tonumber(ARGV[3])
for _, key in ipairs(KEYS) do
  local value = redis.call('GET', key)
  local rest = nil
  if value then
    local at = string.find(value, needle, 1, true)
    if at then
      local after = string.find(value, '\\n', at + 1, true)
      rest = string.sub(value, 1, at - 1) .. (after and string.sub(value, after) or '')
    elseif expiry ~= '' then
      local kept = {}
      for entry, ms in string.gmatch(value, '(\\n[^\\n]* (%d+))') do
        if tonumber(ms) > now then kept[#kept + 1] = entry end
      end
      rest = table.concat(kept)
    end
  end
  if expiry ~= '' then
    local updated = (rest or '') .. needle .. expiry
    if value then
      redis.call('SET', key, updated, 'KEEPTTL')
      redis.call('PEXPIREAT', key, expiry, 'GT')
    else
      redis.call('SET', key, updated, 'PXAT', expiry)
    end
  elseif rest == '' then
    redis.call('DEL', key)
  elseif rest then
    redis.call('SET', key, rest, 'KEEPTTL')
  end
end
return 0
"""

# Add members to one location's LRU, drop members older than the TTL (their entries have
# expired), then pop the oldest members beyond capacity and return them, oldest first.
# KEYS[1] = LRU sorted set; ARGV = capacity in blocks (-1: unbounded), expired-before score, ttl
# ms, then score/member pairs to add.
_LRU_LUA = """
for i = 4, #ARGV, 2 do redis.call('ZADD', KEYS[1], ARGV[i], ARGV[i + 1]) end
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
Pipeline = Any  # redis.asyncio Pipeline or ClusterPipeline: no common typed base
Holders = tuple[float, frozenset[Location], tuple[tuple[float, Location], ...]]


@contextmanager
def _mapped_errors() -> Iterator[None]:
    try:
        yield
    except (RedisError, RedisClusterException) as e:
        raise IndexUnavailable(f"{type(e).__name__}: {e}") from e


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _parse_holders(value: bytes) -> Holders:
    """(earliest expiry ms, every holder, (expiry ms, holder) pairs) of one block's value."""
    entries = []
    for entry in value.split(b"\n")[1:]:
        location, _, expiry_ms = entry.rpartition(b" ")
        entries.append((float(expiry_ms), Location.parse(location.decode())))
    earliest = min((expiry for expiry, _ in entries), default=0.0)
    return earliest, frozenset(location for _, location in entries), tuple(entries)


class IndexOptions(TypedDict, total=False):
    """RedisIndex's keyword options, which from_url passes on (their defaults: __init__'s)."""

    ttl_s: float
    capacity_blocks: CapacityFn
    spill_to: SpillFn
    key_prefix: str


class RedisIndex:
    """KV index in Redis or Redis Cluster; see the module docstring for the key layout."""

    def __init__(
        self,
        client: RedisClient,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        capacity_blocks: CapacityFn = no_capacity,
        spill_to: SpillFn = no_spill,
        key_prefix: str = DEFAULT_KEY_PREFIX,
    ) -> None:
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError(f"key_prefix {key_prefix!r} must not contain a hash tag")
        self._redis = client
        self._cluster = isinstance(client, RedisCluster)
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._capacity = capacity_blocks
        self._spill_to = spill_to
        self._prefix = key_prefix
        self._last_recency_us = 0
        self._holder_sets: dict[bytes, Holders] = {}
        self._shas: dict[str, str] = {}

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        cluster: bool = False,
        socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
        **options: Unpack[IndexOptions],
    ) -> RedisIndex:
        # No retries: a failed call should reach the gateway's fallback at once, not after backoff.
        connection: dict[str, Any] = {
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": socket_timeout_s,
            "retry": Retry(NoBackoff(), 0),
        }
        client: RedisClient
        if cluster:
            client = RedisCluster.from_url(url, **connection)
        else:
            client = Redis.from_url(url, **connection)
        return cls(client, **options)

    # keys

    def _member(self, model: str, h: int) -> str:
        return f"{_b64(model)}:{h:x}"

    def _block_key(self, member: str) -> str:
        bucket = int(member.rpartition(":")[2], 16) % KEY_BUCKETS
        return f"{self._prefix}:b:{{{bucket:02x}}}:{member}"

    def _block_keys(self, model: str, hashes: Sequence[int]) -> list[str]:
        """`_block_key` of each hash, without building and parsing the member (the hot path)."""
        head = f"{self._prefix}:b:"
        tail = f":{_b64(model)}:"
        return [f"{head}{{{h % KEY_BUCKETS:02x}}}{tail}{h:x}" for h in hashes]

    def _lru_key(self, location: Location) -> str:
        return f"{self._prefix}:lru:{_b64(location.key())}"

    def _groups(self, keys: Sequence[str]) -> list[list[int]]:
        """Positions of `keys` grouped so each group may go in one multi-key command."""
        if not self._cluster:
            return [list(range(len(keys)))]
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            tag = key[key.index("{") : key.index("}")]
            groups.setdefault(tag, []).append(i)
        return list(groups.values())

    # the Index protocol

    async def lookup(self, model: str, hashes: Sequence[int]) -> BlockHits:
        if not hashes:
            return []
        keys = self._block_keys(model, hashes)
        with _mapped_errors():
            values = await self._mget(keys)
        return self._hits(values)

    async def _mget(self, keys: list[str]) -> list[bytes | None]:
        if not self._cluster:
            values: list[Any] = await self._redis.mget(keys)  # bytes or None (no decoding)
            return values
        groups = self._groups(keys)
        pipe = self._redis.pipeline(transaction=False)
        for positions in groups:
            pipe.execute_command("MGET", *(keys[i] for i in positions))
        replies: list[list[bytes | None]] = await pipe.execute()
        ordered: list[bytes | None] = [None] * len(keys)
        for positions, group_values in zip(groups, replies, strict=True):
            for i, value in zip(positions, group_values, strict=True):
                ordered[i] = value
        return ordered

    def _hits(self, values: list[bytes | None]) -> BlockHits:
        now_ms = time.time() * 1000
        cache = self._holder_sets
        hits: BlockHits = []
        for value in values:
            if value is None:
                break
            holders = cache.get(value)
            if holders is None:
                if len(cache) >= HOLDER_SET_CACHE_SIZE:
                    cache.clear()
                holders = cache[value] = _parse_holders(value)
            earliest_ms, everyone, entries = holders
            if earliest_ms > now_ms:
                hits.append(everyone)
                continue
            alive = frozenset(location for expiry_ms, location in entries if expiry_ms > now_ms)
            if not alive:
                break
            hits.append(alive)
        return hits

    async def record(self, model: str, hashes: Sequence[int], location: Location) -> None:
        chain = spill_chain(location, self._spill_to)
        members = [self._member(model, h) for h in hashes]
        pushed_out: list[str] = []
        pushed_from = location
        # Each pass writes `members` into the next location of the chain and removes the previous
        # pass's pushed-out entries from where they were; what it pushes out moves on down.
        for target in [*chain, None]:
            if not members and not pushed_out:
                return
            replies = await self._run(
                partial(self._queue_move, pushed_out, pushed_from, members, target)
            )
            if target is None or not members:
                return
            popped: list[bytes] = replies[-1]
            pushed_out = [member.decode() for member in popped]
            pushed_from = target
            members = pushed_out

    def _queue_move(
        self,
        removed: list[str],
        source: Location,
        added: list[str],
        target: Location | None,
        pipe: Pipeline,
    ) -> None:
        self._queue_remove(pipe, removed, source)
        if target is not None:
            self._queue_add(pipe, added, target)

    async def _run(self, build: Callable[[Pipeline], object]) -> list[Any]:
        """Build and execute one pipeline; (re)load the scripts if Redis lost them (restart)."""
        with _mapped_errors():
            if not self._shas:
                await self._load_scripts()
            for attempt in range(2):
                pipe = self._redis.pipeline(transaction=False)
                build(pipe)
                try:
                    replies: list[Any] = await pipe.execute()
                    return replies
                except NoScriptError:
                    if attempt:
                        raise
                    await self._load_scripts()
        raise AssertionError("unreachable")

    async def _load_scripts(self) -> None:
        # All or nothing: a load cut short (a caller's deadline cancels it between the two
        # scripts) must not leave a half-filled table that every later call trips over.
        shas = {}
        for name, source in (("holder", _HOLDER_LUA), ("lru", _LRU_LUA)):
            shas[name] = await self._redis.script_load(source)
        self._shas = shas

    def _queue_holder(
        self, pipe: Pipeline, members: list[str], location: Location, expiry: str
    ) -> None:
        field = location.key()
        if any(c.isspace() for c in field):
            raise ValueError(f"location {field!r} must not contain whitespace")
        keys = [self._block_key(member) for member in members]
        now_ms = str(time.time_ns() // 1_000_000)
        for positions in self._groups(keys):
            group = [keys[i] for i in positions]
            pipe.execute_command(
                "EVALSHA", self._shas["holder"], len(group), *group, field, expiry, now_ms
            )

    def _queue_remove(self, pipe: Pipeline, members: list[str], location: Location) -> None:
        if members:
            self._queue_holder(pipe, members, location, "")

    def _queue_add(self, pipe: Pipeline, members: list[str], location: Location) -> None:
        now_us = time.time_ns() // 1000
        self._queue_holder(pipe, members, location, str(now_us // 1000 + self._ttl_ms))
        first_us = max(now_us, self._last_recency_us + 1)
        self._last_recency_us = first_us + len(members) - 1
        recency: dict[str, int] = {}
        for i, member in enumerate(members):
            recency[member] = first_us + i  # a repeated hash keeps its latest position, as in LRU
        scored = [arg for member, score in recency.items() for arg in (score, member)]
        capacity = self._capacity(location)
        expired_before_us = now_us - self._ttl_ms * 1000
        args = (-1 if capacity is None else capacity, expired_before_us, self._ttl_ms)
        pipe.execute_command(
            "EVALSHA", self._shas["lru"], 1, self._lru_key(location), *args, *scored
        )

    async def evict(self, model: str, hashes: Sequence[int], location: Location) -> None:
        if not hashes:
            return
        members = [self._member(model, h) for h in hashes]

        def build(pipe: Pipeline) -> None:
            self._queue_remove(pipe, members, location)
            pipe.zrem(self._lru_key(location), *members)

        await self._run(build)

    async def drop_location(self, location: Location) -> None:
        lru = self._lru_key(location)
        for _ in range(1_000_000):  # bounded: at most a billion blocks
            with _mapped_errors():
                popped: list[Any] = await self._redis.zpopmin(lru, DROP_BATCH_BLOCKS)
            if not popped:
                return
            members = [member.decode() for member, _ in popped]
            await self._run(partial(self._queue_remove, members=members, location=location))
            if len(popped) < DROP_BATCH_BLOCKS:
                return

    async def drop_replica(self, replica: str) -> None:
        for tier in (Tier.HBM, Tier.CPU):
            await self.drop_location(Location(replica, tier))

    async def close(self) -> None:
        with _mapped_errors():
            await self._redis.aclose()
