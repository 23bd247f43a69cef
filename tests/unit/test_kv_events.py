"""vLLM KV events: decoding, the engine-hash -> gateway-key map, sequence verdicts (pure)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from gateway.engines.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockMap,
    EventBatch,
    EventDecodeError,
    SeqTracker,
    SeqVerdict,
    Skip,
    precise_namespace,
)
from gateway.engines.vllm import decode_batch, decode_message, encode_batch, encode_seq
from routing.hashing import token_block_hashes
from routing.types import Tier

BS = 4
MODEL = "m"

# What vLLM 0.32 puts on the wire (vllm/distributed/kv_events.py: EventBatch is array_like with
# omit_defaults, events are tagged maps; the DP rank is omitted when None).
STORED_MAP = {
    "type": "BlockStored",
    "block_hashes": [11, 12],
    "parent_block_hash": None,
    "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
    "block_size": 4,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "extra_keys": [["salt-a"], None],
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
}
STORED = BlockStored(
    block_hashes=(11, 12),
    parent_block_hash=None,
    token_ids=(1, 2, 3, 4, 5, 6, 7, 8),
    block_size=4,
    medium="GPU",
    extra_keys=(("salt-a",), None),
    group_idx=0,
)

DECODES = [
    ("map-form", [1.5, [STORED_MAP], 0], EventBatch(1.5, (STORED,), 0)),
    (
        "dp-rank-omitted",
        [2, [{"type": "AllBlocksCleared"}]],
        EventBatch(2.0, (AllBlocksCleared(),)),
    ),
    (
        "removed-map",
        [0.0, [{"type": "BlockRemoved", "block_hashes": [12], "medium": "CPU"}], 0],
        EventBatch(0.0, (BlockRemoved((12,), "CPU"),), 0),
    ),
    (
        "positional-older-form",
        [
            0.0,
            [
                ["BlockStored", [5], 4, [9, 9, 9, 9], 4, None, "GPU"],
                ["BlockRemoved", [5], "GPU"],
                ["AllBlocksCleared"],
            ],
        ],
        EventBatch(
            0.0,
            (
                BlockStored((5,), 4, (9, 9, 9, 9), 4, "GPU"),
                BlockRemoved((5,), "GPU"),
                AllBlocksCleared(),
            ),
        ),
    ),
    (
        "bytes-hashes",
        [0.0, [{"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": None}]],
        EventBatch(0.0, (BlockRemoved((b"\x01" * 32,), None),)),
    ),
]


@pytest.mark.parametrize(("raw", "expected"), [d[1:] for d in DECODES], ids=[d[0] for d in DECODES])
def test_decode_batch(raw: object, expected: EventBatch) -> None:
    assert decode_batch(msgpack.packb(raw)) == expected


BAD = [
    ("not-msgpack", b"\xc1"),
    ("not-an-array", msgpack.packb({"ts": 1})),
    ("events-not-array", msgpack.packb([1.0, {"a": 1}])),
    ("unknown-type", msgpack.packb([1.0, [{"type": "BlockMoved"}]])),
    ("missing-field", msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}]])),
    ("hash-not-int", msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]])),
    ("untagged-event", msgpack.packb([1.0, [[1, 2]]])),
]


@pytest.mark.parametrize("payload", [b[1] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_payloads_raise_decode_error(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_encode_round_trips_and_frames_decode() -> None:
    batch = EventBatch(3.0, (STORED, BlockRemoved((11,), "GPU"), AllBlocksCleared()), 0)
    message = decode_message([b"kv", encode_seq(7), encode_batch(batch)])
    assert (message.topic, message.seq, message.batch) == (b"kv", 7, batch)
    with pytest.raises(EventDecodeError):
        decode_message([b"", encode_seq(7)])
    with pytest.raises(EventDecodeError):
        decode_message([b"", b"\x00" * 4, encode_batch(batch)])


def new_map(capacity: int = 100) -> EngineBlockMap:
    return EngineBlockMap(model=MODEL, block_size_tokens=BS, capacity_blocks=capacity)


def stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: Any) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), kw.pop("block_size", BS), **kw)


TOKENS = list(range(100, 124))  # six blocks of four


def test_keys_from_events_equal_the_requests_keys() -> None:
    """The point of the map: a chain stored in pieces, with opaque engine hashes, gives exactly
    the keys the gateway computes for the same token ids."""
    m = new_map()
    first = m.stored(stored([901, 902], None, TOKENS[:8]))
    rest = m.stored(stored([903, 904, 905], 902, TOKENS[8:20]))
    expected = token_block_hashes(TOKENS, block_size_tokens=BS, namespace=MODEL)
    assert (first.tier, first.skipped) == (Tier.HBM, None)
    assert first.keys + rest.keys == expected[:5]


def test_cache_salt_selects_the_namespace() -> None:
    m = new_map()
    out = m.stored(stored([1], None, TOKENS[:4], extra_keys=(("salt-a",),)))
    salted = token_block_hashes(
        TOKENS[:4], block_size_tokens=BS, namespace=precise_namespace(MODEL, "salt-a")
    )
    assert out.keys == salted
    assert out.keys != token_block_hashes(TOKENS[:4], block_size_tokens=BS, namespace=MODEL)


def test_engine_block_larger_than_the_gateway_block_covers_several_keys() -> None:
    m = new_map()
    out = m.stored(stored([7], None, TOKENS[:8], block_size=8))
    assert out.keys == token_block_hashes(TOKENS[:8], block_size_tokens=BS, namespace=MODEL)
    assert m.removed(BlockRemoved((7,), "GPU")) == (Tier.HBM, out.keys)


SKIPS = [
    ("orphan", stored([5], 404, TOKENS[:4]), Skip.ORPHAN),
    ("block-size-not-multiple", stored([5], None, TOKENS[:6], block_size=6), Skip.BLOCK_SIZE),
    ("tokens-length-mismatch", stored([5, 6], None, TOKENS[:4]), Skip.BLOCK_SIZE),
    ("multimodal", stored([5], None, TOKENS[:4], extra_keys=((("img", 0),),)), Skip.EXTRA_KEYS),
    ("lora", stored([5], None, TOKENS[:4], lora_name="adapter"), Skip.EXTRA_KEYS),
    ("second-group", stored([5], None, TOKENS[:4], group_idx=1), Skip.GROUP),
    ("disk-medium", stored([5], None, TOKENS[:4], medium="STORAGE"), Skip.MEDIUM),
]


@pytest.mark.parametrize(("event", "reason"), [s[1:] for s in SKIPS], ids=[s[0] for s in SKIPS])
def test_unindexable_blocks_are_skipped_with_a_reason(event: BlockStored, reason: Skip) -> None:
    out = new_map().stored(event)
    assert (out.keys, out.skipped) == ([], reason)


def test_removal_resolves_per_medium_and_forgets_when_no_medium_holds_it() -> None:
    m = new_map()
    gpu = m.stored(stored([1], None, TOKENS[:4]))
    cpu = m.stored(stored([1], None, TOKENS[:4], medium="CPU"))
    assert (cpu.tier, cpu.keys) == (Tier.CPU, gpu.keys)
    assert m.removed(BlockRemoved((1,), "GPU")) == (Tier.HBM, gpu.keys)
    assert m.gateway_keys(1) == tuple(gpu.keys)  # the CPU copy still maps it
    assert m.removed(BlockRemoved((1,), "CPU")) == (Tier.CPU, gpu.keys)
    assert m.gateway_keys(1) is None
    assert m.removed(BlockRemoved((1, 99), "GPU")) == (Tier.HBM, [])  # unknown: ignored


def test_a_child_after_its_parent_was_removed_is_an_orphan() -> None:
    m = new_map()
    m.stored(stored([1], None, TOKENS[:4]))
    m.removed(BlockRemoved((1,), "GPU"))
    assert m.stored(stored([2], 1, TOKENS[4:8])).skipped is Skip.ORPHAN


def test_capacity_bounds_the_map() -> None:
    m = new_map(capacity=3)
    m.stored(stored([1, 2, 3, 4, 5], None, TOKENS[:20]))
    assert len(m) == 3 and m.gateway_keys(1) is None and m.gateway_keys(5) is not None


SEQS = [
    ("in-order", 0, [0, 1, 2], [SeqVerdict.APPLY] * 3),
    ("gap", 0, [0, 3], [SeqVerdict.APPLY, SeqVerdict.GAP]),
    ("late-join", 0, [57], [SeqVerdict.GAP]),
    ("restart", 0, [0, 1, 0], [SeqVerdict.APPLY, SeqVerdict.APPLY, SeqVerdict.RESTART]),
    ("duplicate", 5, [5, 5], [SeqVerdict.APPLY, SeqVerdict.RESTART]),
]


@pytest.mark.parametrize(
    ("start", "seqs", "verdicts"), [s[1:] for s in SEQS], ids=[s[0] for s in SEQS]
)
def test_seq_tracker(start: int, seqs: list[int], verdicts: list[SeqVerdict]) -> None:
    tracker = SeqTracker(expected=start)
    seen = []
    for seq in seqs:
        seen.append(tracker.check(seq))
        tracker.applied(seq)
    assert seen == verdicts
