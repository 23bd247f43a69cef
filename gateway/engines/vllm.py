"""vLLM's KV events: the wire codec (ZMQ frames, msgpack payloads) to and from the event types of
gateway/engines/events.py, the replay request, and `VLLM_EVENTS`, vLLM's EventSource.

Wire (vLLM 0.32, vllm/distributed/kv_events.py): ZMQ multipart `[topic, seq, payload]`; `seq` is
a uint64, 8 bytes big-endian, from 0 per engine process, +1 per batch; `payload` is msgpack
`[ts, events]` or `[ts, events, data_parallel_rank]` (the rank is omitted when None). Each event
is a msgpack map tagged by `"type"`; older vLLM sent positional arrays `["BlockStored", ...]`,
which are accepted too.

Replay: a DEALER socket sends `[b"", start_seq]` to the engine's ROUTER; it answers
`[b"", topic, seq, payload]` per buffered batch from start_seq on, then `[b"", b"", 0xff * 8, b""]`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from gateway.engines.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    EventBatch,
    EventDecodeError,
    Message,
)
from gateway.engines.source import ReplayFn

log = logging.getLogger("cachelane.kv_events")

END_OF_REPLAY_SEQ = b"\xff" * 8  # (-1).to_bytes(8, "big", signed=True): the replay end marker
REPLAY_TIMEOUT_S = 2.0  # vLLM serves a replay between engine-queue polls of 0.1 s: ample
MAX_REPLAY_BATCHES = 10_000  # vLLM's replay buffer holds buffer_steps=10_000 batches by default


class VllmEvents:
    """vLLM's KV events as an EventSource (gateway/engines/source.py)."""

    name = "vllm"

    def decode(self, frames: Sequence[bytes]) -> Message:
        return decode_message(frames)

    def replayer(self, ctx: zmq.asyncio.Context, endpoint: str) -> ReplayFn:
        return _replayer(ctx, endpoint)


VLLM_EVENTS = VllmEvents()


# ---------------------------------------------------------------- decoding


def decode_seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise EventDecodeError(f"sequence frame is {len(raw)} bytes, expected 8")
    return int.from_bytes(raw, "big")


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_message(frames: Sequence[bytes]) -> Message:
    """`[topic, seq, payload]` as received from vLLM's PUB socket (or a replay, minus its b"")."""
    if len(frames) != 3:
        raise EventDecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    return Message(bytes(topic), decode_seq(seq), decode_batch(payload))


def decode_batch(payload: bytes) -> EventBatch:
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as err:
        raise EventDecodeError(f"payload is not msgpack: {err}") from None
    if not isinstance(raw, list) or len(raw) not in (2, 3):
        raise EventDecodeError("payload must be an array [ts, events] or [ts, events, dp_rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise EventDecodeError("payload must be [ts (number), events (array), ...]")
    if rank is not None and not isinstance(rank, int):
        raise EventDecodeError("data_parallel_rank must be an int or nil")
    return EventBatch(float(ts), tuple(decode_event(e) for e in events), rank)


_POSITIONAL_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def decode_event(raw: object) -> Event:
    """One event: a map tagged by "type" (vLLM >= 0.11), or `[tag, field, ...]` (older)."""
    if isinstance(raw, dict):
        fields = raw
        kind = fields.get("type")
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _POSITIONAL_FIELDS.get(kind)
        if names is None:
            raise EventDecodeError(f"unknown event type {kind!r}")
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise EventDecodeError("an event must be a map with 'type' or an array [type, ...]")
    try:
        if kind == "BlockStored":
            return BlockStored(
                block_hashes=_hashes(fields["block_hashes"]),
                parent_block_hash=_opt_hash(fields.get("parent_block_hash")),
                token_ids=_ints(fields["token_ids"], "token_ids"),
                block_size=_int(fields["block_size"], "block_size"),
                medium=_opt_str(fields.get("medium"), "medium"),
                lora_name=_opt_str(fields.get("lora_name"), "lora_name"),
                extra_keys=_extra_keys(fields.get("extra_keys")),
                group_idx=_opt_int(fields.get("group_idx"), "group_idx"),
            )
        if kind == "BlockRemoved":
            return BlockRemoved(
                block_hashes=_hashes(fields["block_hashes"]),
                medium=_opt_str(fields.get("medium"), "medium"),
                group_idx=_opt_int(fields.get("group_idx"), "group_idx"),
            )
    except KeyError as err:
        raise EventDecodeError(f"{kind} without {err.args[0]!r}") from None
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventDecodeError(f"unknown event type {kind!r}")


def _hash(v: object) -> EngineHash:
    if isinstance(v, bool) or not isinstance(v, int | bytes):
        raise EventDecodeError(f"a block hash must be an int or bytes, got {type(v).__name__}")
    return v


def _opt_hash(v: object) -> EngineHash | None:
    return None if v is None else _hash(v)


def _hashes(v: object) -> tuple[EngineHash, ...]:
    if not isinstance(v, list):
        raise EventDecodeError("block_hashes must be an array")
    return tuple(_hash(h) for h in v)


def _int(v: object, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise EventDecodeError(f"{name} must be an int")
    return v


def _opt_int(v: object, name: str) -> int | None:
    return None if v is None else _int(v, name)


def _ints(v: object, name: str) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise EventDecodeError(f"{name} must be an array")
    return tuple(_int(t, name) for t in v)


def _opt_str(v: object, name: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise EventDecodeError(f"{name} must be a string or nil")
    return v


def _extra_keys(v: object) -> tuple[tuple[Any, ...] | None, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise EventDecodeError("extra_keys must be an array or nil")
    return tuple(None if k is None else tuple(k) if isinstance(k, list) else (k,) for k in v)


# ---------------------------------------------------------------- encoding (publishers, tests)


def event_to_wire(event: Event) -> dict[str, Any]:
    """An event as vLLM 0.32 puts it on the wire: a map tagged by "type"; defaults omitted."""
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            out["extra_keys"] = [None if k is None else list(k) for k in event.extra_keys]
        if event.group_idx is not None:
            out["group_idx"] = event.group_idx
        return out
    if isinstance(event, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes)}
        out["medium"] = event.medium
        if event.group_idx is not None:
            out["group_idx"] = event.group_idx
        return out
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: EventBatch) -> bytes:
    body: list[Any] = [batch.ts, [event_to_wire(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


# ---------------------------------------------------------------- replay


def _replayer(ctx: zmq.asyncio.Context, endpoint: str) -> ReplayFn:
    async def replay(start_seq: int) -> list[list[bytes]] | None:
        """vLLM's replay protocol: DEALER sends [b"", start_seq]; the ROUTER answers
        [b"", topic, seq, payload] per buffered batch from start_seq on, then
        [b"", b"", 0xff * 8, b""]."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        out: list[list[bytes]] = []
        try:
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                await sock.send_multipart([b"", encode_seq(start_seq)])
                while len(out) <= MAX_REPLAY_BATCHES:
                    frames = await sock.recv_multipart()
                    if len(frames) == 4 and frames[2] == END_OF_REPLAY_SEQ:
                        return out
                    if len(frames) != 4 or frames[0] != b"":
                        log.warning("unexpected replay frames from %s", endpoint)
                        return None
                    out.append(frames[1:])
            return None
        except TimeoutError:
            log.warning("replay from %s timed out after %.1f s", endpoint, REPLAY_TIMEOUT_S)
            return None
        finally:
            sock.close(linger=0)

    return replay
