"""The memory index's tables are invisible to CPython's cyclic GC, and its numbered holder sets
are bounded: a full collection does not walk one object per block."""

import gc
import random

import pytest

from routing import index as index_module
from routing.index import MemoryIndex
from routing.types import Location, Tier

MODEL = "m"


def fill(index: MemoryIndex, replicas: int, prompts: int, blocks: int) -> list[tuple[int, ...]]:
    """Tuples of ints, which the GC stops tracking: only the index's objects are counted."""
    rng = random.Random(1)
    sent = []
    for r in range(replicas):
        for _ in range(prompts):
            hashes = tuple(rng.getrandbits(64) for _ in range(blocks))
            index.record_now(MODEL, hashes, Location(f"r{r}", Tier.HBM))
            index.record_now(
                MODEL, hashes[: blocks // 2], Location(f"r{(r + 1) % replicas}", Tier.CPU)
            )
            sent.append(hashes)
    return sent


def test_recording_and_looking_up_blocks_adds_no_objects_the_gc_tracks() -> None:
    index = MemoryIndex()
    fill(index, replicas=2, prompts=2, blocks=8)  # the index's own few objects exist
    gc.collect()
    before = len(gc.get_objects())
    sent = fill(index, replicas=8, prompts=20, blocks=128)  # 20k blocks
    hits = [index.lookup_now(MODEL, hashes) for hashes in sent]
    assert all(len(h) == 128 for h in hits)
    del hits
    gc.collect()
    # 16 locations, their LRUs and holder sets: not 20k
    assert len(gc.get_objects()) - before < 100


def test_past_the_numbered_sets_blocks_are_looked_up_unfrozen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(index_module, "MAX_HOLDER_SETS", 2)
    index = MemoryIndex()
    sent = fill(index, replicas=4, prompts=3, blocks=16)
    for _ in range(2):  # the second lookup of each prompt takes the frozen path where it can
        for r, hashes in enumerate(sent):
            hits = index.lookup_now(MODEL, hashes)
            replica = r // 3
            assert [Location(f"r{replica}", Tier.HBM) in h for h in hits] == [True] * 16
            cpu = Location(f"r{(replica + 1) % 4}", Tier.CPU)
            assert [cpu in h for h in hits] == [True] * 8 + [False] * 8


def test_a_hash_outside_64_bits_is_refused_and_looked_up_as_a_miss() -> None:
    index = MemoryIndex()
    where = Location("r0", Tier.HBM)
    for bad in (-1, 1 << 64):
        with pytest.raises(ValueError, match="64-bit"):
            index.record_now(MODEL, [1, bad], where)
    assert index.entries() == 0
    index.record_now(MODEL, [1, (1 << 64) - 1], where)
    assert index.lookup_now(MODEL, [1, (1 << 64) - 1]) == [frozenset({where})] * 2
    assert index.lookup_now(MODEL, [-1]) == []
    assert index.lookup_now("other-model", [1]) == []  # the model is part of the key
