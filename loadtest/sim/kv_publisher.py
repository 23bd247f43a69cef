"""The simulated replica's KV event stream, on the wire exactly as vLLM 0.32 sends it.

A ZMQ PUB socket sends `[topic, seq (8 bytes big-endian), msgpack [ts, events, dp_rank]]`, seq
from 0 and +1 per batch; a ROUTER socket answers replay requests (`[b"", start_seq]` from a
DEALER) with every buffered batch from start_seq on, then the end marker
`[b"", b"", 0xff * 8, b""]`, as vllm/distributed/kv_events.py's ZmqEventPublisher does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence

import zmq
import zmq.asyncio

from gateway.engines.events import Event, EventBatch
from gateway.engines.vllm import END_OF_REPLAY_SEQ, encode_batch, encode_seq

log = logging.getLogger(__name__)

BUFFER_BATCHES = 10_000  # vLLM's KVEventsConfig.buffer_steps default


class KvEventPublisher:
    def __init__(
        self, host: str, port: int, replay_port: int | None = None, topic: str = ""
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(f"tcp://{host}:{port}")
        self._replay: zmq.asyncio.Socket | None = None
        if replay_port is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(f"tcp://{host}:{replay_port}")
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=BUFFER_BATCHES)
        self.next_seq = 0
        self.drop_next = 0  # batches to number but not send: lets tests make a real gap

    @property
    def endpoint(self) -> str:
        return str(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))

    def publish(self, events: Sequence[Event]) -> None:
        """Send one batch now (PUB never blocks: with no subscriber it is dropped, as in vLLM)."""
        if not events:
            return
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        payload = encode_batch(EventBatch(time.time(), tuple(events), 0))
        self._buffer.append((seq, payload))
        if self.drop_next > 0:
            self.drop_next -= 1
            return
        self._pub.send_multipart([self._topic, encode_seq(seq), payload], flags=zmq.NOBLOCK)

    async def _serve_replay(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await sock.send_multipart([client, b"", self._topic, encode_seq(seq), payload])
            await sock.send_multipart([client, b"", b"", END_OF_REPLAY_SEQ, b""])

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[KvEventPublisher]:
        task = None
        if self._replay is not None:
            task = asyncio.create_task(self._serve_replay(self._replay), name="kv-replay")
        try:
            yield self
        finally:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            self._ctx.destroy(linger=0)
