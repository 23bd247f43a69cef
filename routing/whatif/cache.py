"""The cache model the planner replays: per-replica HBM and CPU tiers, shared remote tiers.

Every tier is a block LRU (capacity in blocks, least recently used evicted first), and a request
moves blocks between them the way vLLM with an offloading connector does, and the way the
simulated replicas do (loadtest/sim/engine.py), so a plan can be checked against a run:

  lookup     the prompt's leading blocks: g in HBM, then c more in the CPU tier, then m more in
             the remote tier (a remote lookup refreshes what it found); at most
             (prompt_tokens - 1) // block_size blocks, since the engine always computes the
             last prompt token (vllm/v1/core/kv_cache_manager.py get_computed_blocks)
  place      after the prefill every prompt block is in HBM, last block first, so a prompt's
             tail is evicted before its prefix (vLLM frees a request's blocks tail first);
             what HBM evicts is demoted to the CPU tier, whose own overflow is dropped;
             the swapped-in blocks are refreshed in the CPU tier
  write      an admitted prompt's blocks are offered to the remote tier; it stores the ones it
             lacks (written bytes count those), evicting its least recent blocks

The remote tier remembers, per block, whether it was read since it was written: a block evicted
unread, or still unread when the replay ends, is a write that bought nothing.

Pure: no IO, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class BlockLRU:
    """Which block hashes a tier holds; capacity in blocks (0 holds nothing).

    The one block LRU of the project: the what-if replay's tiers here and the simulated replica's
    tiers (loadtest/sim/tiers.py) both use it, so a plan and a simulated run evict alike."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def prefix_len(self, hashes: Sequence[int], start: int = 0) -> int:
        """How many of hashes[start:] are held, up to the first one missing."""
        n = 0
        for h in hashes[start:]:
            if h not in self._blocks:
                break
            n += 1
        return n

    def touch(self, hashes: Iterable[int]) -> None:
        """Mark the held ones among `hashes` used now, in order (the last is the most recent)."""
        for h in hashes:
            if h in self._blocks:
                self._blocks.move_to_end(h)

    def insert(self, hashes: Iterable[int]) -> list[int]:
        """Add or refresh `hashes` in order (the last is the most recent); return the evicted,
        least recent first.

        Eviction runs after all are added, so inserting more blocks than the capacity evicts the
        earliest-inserted of them too.
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


@dataclass(frozen=True, slots=True)
class Placement:
    """What placing one prompt in a replica's tiers moved, in blocks."""

    inserted_hbm: int  # blocks newly in HBM (not there before)
    evicted_hbm: int  # blocks HBM evicted
    demoted_cpu: int  # of those, newly copied to the CPU tier
    dropped_cpu: int  # blocks the CPU tier evicted


class ReplicaCache:
    """One replica's HBM and (optional) CPU tier."""

    def __init__(self, hbm_blocks: int, cpu_blocks: int) -> None:
        self.hbm = BlockLRU(hbm_blocks)
        self.cpu = BlockLRU(cpu_blocks) if cpu_blocks > 0 else None

    def local_prefix(self, reusable: Sequence[int]) -> tuple[int, int]:
        """(g, c): leading blocks in HBM, then the CPU tier's extension of them."""
        g = self.hbm.prefix_len(reusable)
        c = self.cpu.prefix_len(reusable, g) if self.cpu is not None else 0
        return g, c

    def place(self, hashes: Sequence[int], swapped_in: Sequence[int]) -> Placement:
        inserted = sum(1 for h in hashes if h not in self.hbm)
        evicted = self.hbm.insert(reversed(hashes))
        demoted = dropped = 0
        if self.cpu is not None:
            self.cpu.touch(reversed(swapped_in))
            demoted = sum(1 for h in evicted if h not in self.cpu)
            dropped = len(self.cpu.insert(evicted))
        return Placement(inserted, len(evicted), demoted, dropped)


@dataclass(slots=True)
class RemoteStats:
    written_blocks: int = 0  # newly stored
    read_blocks: int = 0  # fetched by a request (remote hits served)
    evicted_blocks: int = 0
    evicted_unread_blocks: int = 0  # evicted without a read since they were written


class RemoteTier:
    """A shared remote KV tier: a block LRU that knows which blocks were read since written."""

    def __init__(self, capacity_blocks: int) -> None:
        self.blocks = BlockLRU(capacity_blocks)
        self._read: dict[int, bool] = {}  # held block -> read since written
        self.stats = RemoteStats()

    def lookup(self, hashes: Sequence[int]) -> int:
        """Leading blocks held; those are refreshed (the tier saw them asked for)."""
        n = self.blocks.prefix_len(hashes)
        self.blocks.touch(reversed(hashes[:n]))
        return n

    def read(self, hashes: Sequence[int]) -> None:
        """These blocks were fetched by a request."""
        for h in hashes:
            if h in self._read:
                self._read[h] = True
        self.stats.read_blocks += len(hashes)

    def write(self, hashes: Sequence[int]) -> int:
        """Store a prompt's blocks; returns how many were new."""
        new = [h for h in hashes if h not in self.blocks]
        for h in new:
            self._read[h] = False
        for gone in self.blocks.insert(reversed(hashes)):
            self.stats.evicted_blocks += 1
            if not self._read.pop(gone, True):
                self.stats.evicted_unread_blocks += 1
        self.stats.written_blocks += len(new)
        return len(new)

    def resident_unread(self) -> int:
        """Blocks held now that were never read since they were written."""
        return sum(1 for was_read in self._read.values() if not was_read)
