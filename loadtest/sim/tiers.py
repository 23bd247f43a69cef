"""A KV cache tier as a block LRU: which chained block hashes it holds, evicting the least recent.

Pure bookkeeping, no I/O and no timing. Capacity is in blocks; a tier of capacity 0 holds nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class BlockLRU:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def prefix_len(self, hashes: Sequence[int], start: int = 0) -> int:
        """How many of hashes[start:] are held, counting from start up to the first one missing."""
        n = 0
        for h in hashes[start:]:
            if h not in self._blocks:
                break
            n += 1
        return n

    def touch(self, hashes: Iterable[int]) -> None:
        """Mark the held ones among `hashes` as used now, in order (the last is the most recent)."""
        for h in hashes:
            if h in self._blocks:
                self._blocks.move_to_end(h)

    def insert(self, hashes: Iterable[int]) -> list[int]:
        """Add or refresh `hashes` in order (the last is the most recent); return the evicted ones.

        Eviction runs after all are added, least recent first, so inserting more blocks than the
        capacity evicts the earliest-inserted of them too.
        """
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        evicted: list[int] = []
        while len(self._blocks) > self.capacity_blocks:
            evicted.append(self._blocks.popitem(last=False)[0])
        return evicted

    def clear(self) -> None:
        self._blocks.clear()
