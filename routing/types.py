"""Small value types shared by the routing core."""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple


class Tier(StrEnum):
    """Where a KV block lives."""

    HBM = "hbm"  # GPU memory of one replica: free to reuse
    CPU = "cpu"  # CPU RAM of one replica (offload tier): swap-in over PCIe
    REMOTE = "remote"  # a shared remote KV tier: a network fetch


class TenantClass(StrEnum):
    CRITICAL = "critical"
    STANDARD = "standard"
    BATCH = "batch"


ENGINE_PRIORITY = {TenantClass.CRITICAL: -1, TenantClass.STANDARD: 0, TenantClass.BATCH: 1}
# vLLM's `priority` (--scheduling-policy priority): lower runs first, requests without it are 0, so
# standard traffic and clients that go direct rank alike, critical before them, batch after.


class Location(NamedTuple):
    """One place that can hold KV blocks: a replica's HBM or CPU tier, or a named remote tier.

    A NamedTuple rather than a dataclass: membership tests on sets of locations run once per
    block per candidate in decide(), and tuple hashing is ~5x faster."""

    holder: str  # replica name, or remote tier name for Tier.REMOTE
    tier: Tier

    def key(self) -> str:
        return f"{self.tier.value}:{self.holder}"

    @classmethod
    def parse(cls, key: str) -> Location:
        tier, _, holder = key.partition(":")
        return cls(holder=holder, tier=Tier(tier))


BlockHits = list[frozenset[Location]]
"""Per block of a prompt, in order, the locations that hold it.

Ends before the first block that no location holds."""
