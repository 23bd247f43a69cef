"""BlockLRU: the one block LRU (routing/whatif/cache.py) behind the what-if replay's tiers and the
simulated replica's (loadtest/sim/tiers.py)."""

from __future__ import annotations

import pytest

from loadtest.sim import tiers as sim_tiers
from routing.whatif.cache import BlockLRU


def lru(capacity_blocks: int, *inserted: int) -> BlockLRU:
    tier = BlockLRU(capacity_blocks)
    tier.insert(inserted)
    return tier


@pytest.mark.parametrize(
    ("tier", "hashes", "start", "expected"),
    [
        (lru(4), [1, 2, 3], 0, 0),
        (lru(4, 1, 2, 3), [1, 2, 3], 0, 3),
        (lru(4, 1, 2, 3), [1, 2, 3, 4], 0, 3),
        (lru(4, 1, 3), [1, 2, 3], 0, 1),
        (lru(4, 2, 3), [1, 2, 3], 0, 0),
        (lru(4, 2, 3), [1, 2, 3], 1, 2),
        (lru(4, 1, 2, 3), [1, 2, 3], 3, 0),
        (lru(4, 1, 2, 3), [], 0, 0),
        (lru(0, 1, 2), [1, 2], 0, 0),
    ],
    ids=[
        "empty-tier",
        "whole-prefix",
        "stops-at-first-miss",
        "gap-ends-prefix",
        "first-block-missing",
        "from-offset",
        "offset-at-end",
        "no-hashes",
        "zero-capacity-holds-nothing",
    ],
)
def test_prefix_len(tier: BlockLRU, hashes: list[int], start: int, expected: int) -> None:
    assert tier.prefix_len(hashes, start) == expected


@pytest.mark.parametrize(
    ("capacity", "ops", "evicted", "held"),
    [
        (3, [("insert", [1, 2, 3])], [], {1, 2, 3}),
        (3, [("insert", [1, 2, 3]), ("insert", [4])], [1], {2, 3, 4}),
        (3, [("insert", [1, 2, 3]), ("touch", [1]), ("insert", [4])], [2], {1, 3, 4}),
        (3, [("insert", [1, 2, 3]), ("insert", [1]), ("insert", [4, 5])], [2, 3], {1, 4, 5}),
        (2, [("insert", [1, 2, 3, 4])], [1, 2], {3, 4}),
        (2, [("insert", [4, 3, 2, 1])], [4, 3], {1, 2}),
        (3, [("insert", [1, 2]), ("touch", [9])], [], {1, 2}),
        (3, [("insert", [1, 2, 2, 1])], [], {1, 2}),
        (0, [("insert", [1, 2])], [1, 2], set()),
    ],
    ids=[
        "fits",
        "evicts-least-recent",
        "touch-refreshes",
        "reinsert-refreshes",
        "overflow-evicts-earliest-of-batch",
        "reversed-insert-keeps-prefix",
        "touch-ignores-absent",
        "duplicates-count-once",
        "zero-capacity",
    ],
)
def test_insert_and_touch_evict_lru(
    capacity: int, ops: list[tuple[str, list[int]]], evicted: list[int], held: set[int]
) -> None:
    tier = BlockLRU(capacity)
    gone: list[int] = []
    for op, hashes in ops:
        if op == "insert":
            gone = tier.insert(hashes)
        else:
            tier.touch(hashes)
    assert gone == evicted
    assert len(tier) == len(held)
    assert all(h in tier for h in held)


def test_clear_empties_the_tier() -> None:
    tier = lru(4, 1, 2, 3)
    tier.clear()
    assert len(tier) == 0
    assert tier.prefix_len([1, 2, 3]) == 0


def test_negative_capacity_is_rejected() -> None:
    with pytest.raises(ValueError, match="capacity_blocks"):
        BlockLRU(-1)


def test_the_simulator_uses_the_same_lru() -> None:
    assert sim_tiers.BlockLRU is BlockLRU
