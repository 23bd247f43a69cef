"""Precise mode's index feed: one ZMQ SUB socket per replica on its engine's KV event stream.

Each replica's batches are decoded by the engine's EventSource (gateway/engines/source.py; vLLM's
is gateway/engines/vllm.py), checked against the sequence the engine process is at, mapped from
engine hashes to the gateway's keys, and applied to the index:
  BlockStored   -> record the blocks' keys in the medium's tier (GPU -> HBM, CPU -> CPU)
  BlockRemoved  -> evict them from that tier
  AllBlocksCleared -> drop every entry of the replica (and its engine-hash map)
  a gap in seq  -> ask the replica's replay socket for the missing batches; if it cannot give all
                   of them, drop the replica's entries and go on from the live stream (resync)
  seq backwards -> a new engine process: drop its entries and its map, start again from seq 0
so the index never routes on a replica's stale state longer than until its next batch. Entries
are dropped, not kept "probably right": a missed BlockRemoved would otherwise route to a block the
engine no longer holds until its TTL.

`ReplicaFeed` is the state machine and owns no socket (tests feed it bytes); `KvEvents` owns the
ZMQ context, one subscriber task per replica, and the replay requests (made by the EventSource).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from gateway.config import GatewayConfig
from gateway.engines.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockMap,
    EventBatch,
    EventDecodeError,
    Message,
    SeqTracker,
    SeqVerdict,
)
from gateway.engines.source import EventSource, ReplayFn
from gateway.engines.vllm import VLLM_EVENTS
from gateway.telemetry.metrics import Metrics
from routing.cost import HBM_CAPACITY_TOKENS
from routing.index import Index
from routing.types import Location

log = logging.getLogger("cachelane.kv_events")

SUB_HWM = 100_000  # as vLLM's PUB high-water mark (KVEventsConfig.hwm)
HEARTBEAT_IVL_MS = 1_000  # ZMTP heartbeats find a dead TCP peer, so the SUB socket reconnects
HEARTBEAT_TIMEOUT_MS = 3_000
MAP_SLACK = 2  # engine-hash map: up to twice the blocks the replica can hold in HBM + CPU


class ReplicaFeed:
    """One replica's event stream, applied to the index in order."""

    def __init__(
        self,
        replica: str,
        *,
        model: str,
        block_size_tokens: int,
        capacity_blocks: int,
        index: Index,
        metrics: Metrics,
        replay: ReplayFn | None = None,
        clock: Callable[[], float] = time.monotonic,
        source: EventSource = VLLM_EVENTS,
    ) -> None:
        self.replica = replica
        self._source = source
        self.model = model
        self.blocks = EngineBlockMap(
            model=model, block_size_tokens=block_size_tokens, capacity_blocks=capacity_blocks
        )
        self.seq = SeqTracker()
        self._index = index
        self._metrics = metrics
        self._replay = replay
        self._clock = clock
        self.batches = 0
        self.last_batch_s: float | None = None

    def status(self) -> dict[str, Any]:
        age = None if self.last_batch_s is None else round(self._clock() - self.last_batch_s, 3)
        return {
            "batches": self.batches,
            "next_seq": self.seq.expected,
            "last_batch_age_s": age,
            "mapped_blocks": len(self.blocks),
        }

    def replica_down(self) -> None:
        """The replica failed its health checks: whatever comes next may be a new process (whose
        first batches may be lost), so the next batch is checked as if from a fresh start."""
        self.blocks.clear()
        self.seq.restart()

    async def handle(self, frames: Sequence[bytes]) -> None:
        """One multipart message from the SUB socket."""
        try:
            message = self._source.decode(frames)
        except EventDecodeError as err:
            self._metrics.kv_events_skipped.labels(self.replica, "undecodable").inc()
            log.warning("%s: undecodable KV event message: %s", self.replica, err)
            return
        verdict = self.seq.check(message.seq)
        if verdict is SeqVerdict.RESTART:
            log.info(
                "%s: KV event seq went back to %d: engine restarted", self.replica, message.seq
            )
            await self._resync("restart", forget_map=True)
            self.seq.restart()
            verdict = self.seq.check(message.seq)
        if verdict is SeqVerdict.GAP:
            self._metrics.kv_event_gaps.labels(self.replica).inc()
            if not await self._fill_gap(self.seq.expected, message.seq):
                await self._resync("gap", forget_map=False)
        await self._apply(message)

    async def _fill_gap(self, start: int, until: int) -> bool:
        """Replay batches [start, until) in order; False if any of them cannot be had."""
        if self._replay is None:
            return False
        frames = await self._replay(start)
        outcome = "incomplete"
        try:
            if frames is None:
                outcome = "failed"
                return False
            messages = [self._source.decode(f) for f in frames]
            wanted = [m for m in messages if start <= m.seq < until]
            if [m.seq for m in wanted] != list(range(start, until)):
                return False
            for m in wanted:
                await self._apply(m)
            outcome = "filled"
            return True
        except EventDecodeError as err:
            log.warning("%s: undecodable replay: %s", self.replica, err)
            return False
        finally:
            self._metrics.kv_event_replays.labels(self.replica, outcome).inc()
            log.info("%s: replay of seq %d..%d: %s", self.replica, start, until - 1, outcome)

    async def _resync(self, cause: str, *, forget_map: bool) -> None:
        self._metrics.kv_event_resyncs.labels(self.replica, cause).inc()
        if forget_map:
            self.blocks.clear()
        await self._index_op("drop_replica", self._index.drop_replica(self.replica))

    async def _apply(self, message: Message) -> None:
        await self.apply_batch(message.batch)
        self.seq.applied(message.seq)
        self.batches += 1
        self.last_batch_s = self._clock()

    async def apply_batch(self, batch: EventBatch) -> None:
        for event in batch.events:
            kind = type(event).__name__
            self._metrics.kv_events.labels(self.replica, kind).inc()
            if isinstance(event, BlockStored):
                stored = self.blocks.stored(event)
                if stored.skipped is not None:
                    self._metrics.kv_events_skipped.labels(self.replica, stored.skipped).inc()
                    if stored.skipped == "medium":
                        log.info("%s: ignoring KV events on medium %r", self.replica, event.medium)
                if stored.keys and stored.tier is not None:
                    where = Location(self.replica, stored.tier)
                    await self._index_op(
                        "record", self._index.record(self.model, stored.keys, where)
                    )
            elif isinstance(event, BlockRemoved):
                tier, keys = self.blocks.removed(event)
                if keys and tier is not None:
                    where = Location(self.replica, tier)
                    await self._index_op("evict", self._index.evict(self.model, keys, where))
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()
                await self._index_op("drop_replica", self._index.drop_replica(self.replica))

    async def _index_op(self, op: str, call: Awaitable[None]) -> None:
        try:
            await call
        except Exception as err:  # the index may be away; the next batches bring it back up
            self._metrics.index_errors.labels(f"kv_event_{op}").inc()
            log.warning("%s: index %s failed: %r", self.replica, op, err)


class KvEvents:
    """Every replica's subscriber, owned by the gateway's lifespan."""

    def __init__(
        self,
        config: GatewayConfig,
        replicas: Sequence[tuple[str, str, Any]],
        index: Index,
        metrics: Metrics,
        source: EventSource = VLLM_EVENTS,
    ) -> None:
        """`replicas`: (name, url, pool config) of every replica; `source`: the engines' event
        format (every replica's engine speaks the same)."""
        self._ctx = zmq.asyncio.Context()
        self._subscribers: list[_Subscriber] = []
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._block = config.routing.block_size_tokens
        self._index, self._metrics, self._source = index, metrics, source
        for name, url, pool in replicas:
            self._subscribe(name, url, pool)

    def _subscribe(self, name: str, url: str, pool: Any) -> _Subscriber | None:
        events = pool.kv_events
        if events is None or not pool.models:
            return None
        replay_endpoint = events.replay_endpoint_for(url)
        replay = self._source.replayer(self._ctx, replay_endpoint) if replay_endpoint else None
        hbm = pool.hbm_capacity_tokens or HBM_CAPACITY_TOKENS  # a bound on the map, not routing
        capacity = MAP_SLACK * (hbm + pool.cpu_capacity_tokens) // self._block
        feed = ReplicaFeed(
            name,
            model=pool.models[0],
            block_size_tokens=self._block,
            capacity_blocks=max(capacity, 1),
            index=self._index,
            metrics=self._metrics,
            replay=replay,
            source=self._source,
        )
        endpoint = events.endpoint_for(url)
        subscriber = _Subscriber(self._ctx, feed, endpoint, events.topic)
        self._subscribers.append(subscriber)
        return subscriber

    @property
    def feeds(self) -> dict[str, ReplicaFeed]:
        return {s.feed.replica: s.feed for s in self._subscribers}

    def status(self) -> dict[str, Any]:
        return {
            s.feed.replica: {"endpoint": s.endpoint, **s.feed.status()} for s in self._subscribers
        }

    def start(self) -> list[asyncio.Task[None]]:
        """Run the subscribers not yet running (add() runs its own at once)."""
        return [self._run(s) for s in self._subscribers if s.feed.replica not in self._tasks]

    def _run(self, s: _Subscriber) -> asyncio.Task[None]:
        task = asyncio.create_task(s.run(), name=f"kv-events {s.feed.replica}")
        self._tasks[s.feed.replica] = task
        return task

    def add(self, name: str, url: str, pool: Any) -> None:
        """Follow the events of a replica that joined the fleet (if its pool has them)."""
        subscriber = self._subscribe(name, url, pool)
        if subscriber is not None:
            self._run(subscriber)

    def remove(self, name: str) -> None:
        """Stop following a replica that left."""
        self._subscribers = [s for s in self._subscribers if s.feed.replica != name]
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()

    async def wait_connected(self, timeout_s: float) -> bool:
        """True once every subscriber's TCP connection is up (tests and start-up logs)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(s.connected.wait() for s in self._subscribers))
                return True
        return False

    async def aclose(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._ctx.destroy(linger=0)


class _Subscriber:
    def __init__(
        self, ctx: zmq.asyncio.Context, feed: ReplicaFeed, endpoint: str, topic: str
    ) -> None:
        self._ctx = ctx
        self.feed = feed
        self.endpoint = endpoint
        self._topic = topic.encode()
        self.connected = asyncio.Event()

    async def run(self) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, SUB_HWM)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.SUBSCRIBE, self._topic)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        watch = asyncio.create_task(self._watch(monitor), name=f"kv-monitor {self.feed.replica}")
        sock.connect(self.endpoint)
        log.info("%s: subscribed to KV events at %s", self.feed.replica, self.endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    await self.feed.handle(frames)
                except Exception:  # one bad batch must not end the feed
                    log.exception("%s: KV event batch failed", self.feed.replica)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        await monitor.recv_multipart()
        self.connected.set()
