"""A replica's KV event feed applied to the memory index: stored, removed, cleared, gaps and
restarts. Frames are real bytes; the index is the real MemoryIndex on a fake clock, so every
removal below happens at once, not by a TTL running out."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gateway.engines.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch
from gateway.engines.feed import ReplicaFeed
from gateway.engines.vllm import encode_batch, encode_seq
from gateway.telemetry.metrics import Metrics
from routing.hashing import token_block_hashes
from routing.index import MemoryIndex
from routing.types import Location, Tier

BS = 4
MODEL = "m"
REPLICA = "r0:8000"
HBM, CPU = Location(REPLICA, Tier.HBM), Location(REPLICA, Tier.CPU)
TOKENS = list(range(200, 232))  # eight blocks
KEYS = token_block_hashes(TOKENS, block_size_tokens=BS, namespace=MODEL)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def frames(seq: int, *events: Event) -> list[bytes]:
    return [b"", encode_seq(seq), encode_batch(EventBatch(0.0, tuple(events), 0))]


def store(first_block: int, count: int, parent: int | None = None, medium: str = "GPU") -> Event:
    """Blocks first_block.. of TOKENS, engine hashes 1000 + block index (opaque)."""
    hashes = tuple(1000 + i for i in range(first_block, first_block + count))
    tokens = tuple(TOKENS[first_block * BS : (first_block + count) * BS])
    return BlockStored(hashes, parent, tokens, BS, medium)


def remove(block: int, medium: str = "GPU") -> Event:
    return BlockRemoved((1000 + block,), medium)


class Replay:
    """The replica's replay buffer: every batch it sent, as frames (what its ROUTER returns)."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []
        self.asked: list[int] = []
        self.available = True

    async def __call__(self, start: int) -> list[list[bytes]] | None:
        self.asked.append(start)
        if not self.available:
            return None
        return [f for f in self.sent if int.from_bytes(f[1], "big") >= start]


def make_feed(
    replay: Replay | None = None, clock: Clock | None = None
) -> tuple[ReplicaFeed, MemoryIndex, Metrics]:
    clock = clock or Clock()
    index = MemoryIndex(ttl_s=600.0, clock=clock)
    metrics = Metrics()
    feed = ReplicaFeed(
        REPLICA,
        model=MODEL,
        block_size_tokens=BS,
        capacity_blocks=1000,
        index=index,
        metrics=metrics,
        replay=replay,
        clock=clock,
    )
    return feed, index, metrics


def held(index: MemoryIndex, location: Location) -> int:
    """How many leading blocks of TOKENS the location holds."""
    return sum(1 for hit in index.lookup_now(MODEL, KEYS) if location in hit)


def counter(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def feed_all(feed: ReplicaFeed, messages: Sequence[list[bytes]]) -> None:
    for m in messages:
        await feed.handle(m)


async def test_stored_removed_and_demoted_blocks_follow_the_events() -> None:
    feed, index, metrics = make_feed()
    await feed_all(
        feed,
        [
            frames(0, store(0, 2)),
            frames(1, store(2, 2, parent=1001)),
            frames(2, store(3, 1, parent=1002, medium="CPU"), remove(3)),
        ],
    )
    assert index.lookup_now(MODEL, KEYS) == [frozenset({HBM})] * 3 + [frozenset({CPU})]
    assert counter(metrics, "cachelane_kv_events_total", replica=REPLICA, type="BlockStored") == 3


async def test_all_blocks_cleared_drops_the_replica() -> None:
    feed, index, _ = make_feed()
    await feed_all(feed, [frames(0, store(0, 4)), frames(1, AllBlocksCleared())])
    assert held(index, HBM) == 0 and len(feed.blocks) == 0


async def test_gap_without_replay_drops_entries_and_follows_the_live_stream() -> None:
    feed, index, metrics = make_feed()
    await feed.handle(frames(0, store(0, 2)))
    # seq 1 (say, "remove block 0") is lost; seq 2 arrives
    await feed.handle(frames(2, store(4, 1, parent=1003)))
    assert held(index, HBM) == 0, "entries from before the gap may be stale: dropped"
    assert counter(metrics, "cachelane_kv_event_gaps_total", replica=REPLICA) == 1
    assert counter(metrics, "cachelane_kv_event_resyncs_total", replica=REPLICA, cause="gap") == 1
    await feed.handle(frames(3, store(2, 2, parent=1001)))  # parent still mapped: keys resolve
    assert index.lookup_now(MODEL, KEYS[2:4]) == [frozenset({HBM})] * 2
    assert held(index, HBM) == 0  # but the prefix from block 0 is not indexed any more
    assert feed.seq.expected == 4


async def test_gap_is_filled_from_the_replay_socket() -> None:
    replay = Replay()
    feed, index, metrics = make_feed(replay)
    replay.sent = [
        frames(0, store(0, 2)),
        frames(1, store(2, 2, parent=1001)),
        frames(2, remove(2)),
        frames(3, store(4, 1, parent=1003)),
    ]
    await feed.handle(replay.sent[0])
    await feed.handle(replay.sent[3])  # 1 and 2 were lost on the PUB socket
    assert replay.asked == [1]
    assert held(index, HBM) == 2  # blocks 0-1; 2 was removed
    assert index.lookup_now(MODEL, KEYS[3:5]) == [frozenset({HBM})] * 2
    outcome = {"replica": REPLICA, "outcome": "filled"}
    assert counter(metrics, "cachelane_kv_event_replays_total", **outcome) == 1
    assert counter(metrics, "cachelane_kv_event_resyncs_total", replica=REPLICA, cause="gap") == 0


@pytest.mark.parametrize("available", [False, True], ids=["replay-fails", "replay-too-short"])
async def test_a_replay_that_cannot_fill_the_gap_resyncs(available: bool) -> None:
    replay = Replay()
    replay.available = available
    feed, index, metrics = make_feed(replay)
    replay.sent = [frames(0, store(0, 2))]  # the buffer no longer has seq 1..2
    await feed.handle(replay.sent[0])
    await feed.handle(frames(3, store(4, 1)))
    assert held(index, HBM) == 0
    assert counter(metrics, "cachelane_kv_event_resyncs_total", replica=REPLICA, cause="gap") == 1


async def test_late_join_replays_from_zero() -> None:
    replay = Replay()
    feed, index, _ = make_feed(replay)
    replay.sent = [frames(0, store(0, 2)), frames(1, store(2, 1, parent=1001))]
    await feed.handle(frames(2, store(3, 1, parent=1002)))
    assert replay.asked == [0] and held(index, HBM) == 4


async def test_engine_restart_drops_entries_and_the_hash_map() -> None:
    feed, index, metrics = make_feed()
    await feed_all(feed, [frames(0, store(0, 2)), frames(1, store(2, 2, parent=1001))])
    await feed.handle(frames(0, store(0, 1)))  # a new process: seq from 0, new random hashes
    assert held(index, HBM) == 1
    assert feed.blocks.gateway_keys(1003) is None
    cause = {"replica": REPLICA, "cause": "restart"}
    assert counter(metrics, "cachelane_kv_event_resyncs_total", **cause) == 1


async def test_undecodable_message_is_counted_and_skipped() -> None:
    feed, index, metrics = make_feed()
    await feed.handle([b"", encode_seq(0), b"\xc1"])
    await feed.handle(frames(0, store(0, 1)))
    assert held(index, HBM) == 1
    labels = {"replica": REPLICA, "reason": "undecodable"}
    assert counter(metrics, "cachelane_kv_events_skipped_total", **labels) == 1


async def test_status_reports_age_on_the_feeds_clock() -> None:
    clock = Clock()
    feed, _, _ = make_feed(clock=clock)
    await feed.handle(frames(0, store(0, 1)))
    clock.now += 2.5
    assert feed.status()["last_batch_age_s"] == 2.5 and feed.status()["next_seq"] == 1


async def test_after_the_replica_was_down_the_next_batch_is_checked_from_zero() -> None:
    feed, index, metrics = make_feed()
    await feed_all(feed, [frames(0, store(0, 2)), frames(1, store(2, 1, parent=1001))])
    feed.replica_down()  # the health checker ejected it: the gateway resets its feed
    await index.drop_replica(REPLICA)  # and drops its entries (gateway/wiring.py)
    await feed.handle(frames(0, store(0, 1)))  # a restarted engine, seen from its first batch
    assert held(index, HBM) == 1 and feed.blocks.gateway_keys(1002) is None
    await feed.handle(frames(7, store(5, 1)))  # or a batch from later on: a gap, so a resync
    assert counter(metrics, "cachelane_kv_event_resyncs_total", replica=REPLICA, cause="gap") == 1
