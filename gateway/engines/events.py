"""The KV cache events the index applies, and what they mean for it: engine block hashes turned
into the gateway's own block keys.

The event types are vLLM's (BlockStored, BlockRemoved, AllBlocksCleared in batches with a
sequence number): vLLM is the one engine integration (gateway/engines/vllm.py decodes its wire
format into them), and another engine's events are converted into these types by its own
EventSource (gateway/engines/source.py), so the feed and the index need not know the engine.

Keys: engine block hashes cannot be recomputed by a router (sha256 over a per-process random root,
truncated to 8 bytes on the wire), so they are only ever used as opaque names. `EngineBlockMap`
keeps, per replica, engine hash -> the gateway's keys for that block, where the gateway key of a
block is routing.hashing's chained xxh3 over its token ids, seeded with its parent's gateway key
(or, for a first block, with the namespace root). A request's `token_block_hashes` therefore
meet the keys built from events exactly when the engine holds the same token prefix.

Namespace (tenant isolation): events carry no tenant. The engine isolates tenants only through
the request's `cache_salt`, which vLLM folds into the first block's hash and publishes as a bare
string in that block's `extra_keys`. So the precise-mode namespace is `model` plus that salt when
there is one (`precise_namespace`): the gateway derives the same salt per tenant scope and sends it
(pool `cache_salt: true`), and a first block's salt in an event selects the same namespace. Without
`cache_salt`, tenants share the engine's prefix cache for real, and the index says so: keying by
tenant there would hide real hits, not create isolation. Blocks with multimodal or prompt-embeds
extra keys, or a LoRA adapter, hash differently in the engine than text tokens alone; they are
skipped, and so are their descendants (their parent is then unknown).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from routing.hashing import chain_token_blocks, root_seed
from routing.types import Tier

EngineHash = int | bytes
"""vLLM sends ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default) or raw digests."""

MEDIUM_TIERS = {"GPU": Tier.HBM, "CPU": Tier.CPU}  # vLLM's MEDIUM_GPU / MEDIUM_CPU


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = "GPU"
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class Message:
    """One batch as received from an engine: its topic, its sequence number, its events."""

    topic: bytes
    seq: int
    batch: EventBatch


class EventDecodeError(ValueError):
    """The frames are not an event batch of the engine; the message says what is wrong."""


# ---------------------------------------------------------------- namespace and keys


def precise_namespace(model: str, cache_salt: str | None) -> str:
    """The namespace of precise-mode keys: the model, and the engine's cache_salt if any."""
    return f"{model}|salt:{cache_salt}" if cache_salt else model


def root_salt(event: BlockStored) -> str | None:
    """The cache_salt vLLM published in a first block's extra keys (after a LoRA name, if any)."""
    if not event.extra_keys or event.extra_keys[0] is None:
        return None
    keys = list(event.extra_keys[0])
    if event.lora_name is not None and keys and keys[0] == event.lora_name:
        keys = keys[1:]
    return next((k for k in keys if isinstance(k, str)), None)


def _plain_text_keys(keys: tuple[Any, ...] | None, *, salt_allowed: bool) -> bool:
    """True when a block's extra keys hold nothing but (on a first block) one cache_salt."""
    if keys is None:
        return True
    return salt_allowed and len(keys) == 1 and isinstance(keys[0], str)


class Skip(StrEnum):
    """Why (part of) a BlockStored was not indexed; a metric label."""

    ORPHAN = "orphan"  # its parent's gateway key is unknown (missed, or evicted before it)
    BLOCK_SIZE = "block_size"  # not a multiple of the gateway's block size
    EXTRA_KEYS = "extra_keys"  # multimodal / prompt-embeds / LoRA: not plain text tokens
    GROUP = "group"  # a second KV cache group (hybrid models): group 0 is indexed
    MEDIUM = "medium"  # a medium other than GPU / CPU


@dataclass(slots=True)
class Stored:
    """What one BlockStored means for the index: record `keys` in `tier`."""

    tier: Tier | None
    keys: list[int] = field(default_factory=list)
    skipped: Skip | None = None


@dataclass(slots=True)
class _Known:
    keys: tuple[int, ...]  # the gateway keys this engine block covers, in order
    media: set[Tier]


def tier_of(medium: str | None) -> Tier | None:
    """GPU -> HBM, CPU -> CPU; None (older vLLM, no medium) is GPU; anything else: None."""
    return Tier.HBM if medium is None else MEDIUM_TIERS.get(medium.upper())


class EngineBlockMap:
    """One replica's engine block hashes -> gateway keys, learned from BlockStored events.

    A mapping lives while some medium holds the block, and at most `capacity_blocks` mappings are
    kept (least recently stored dropped first), so missed removals cannot grow it without bound.
    """

    def __init__(self, *, model: str, block_size_tokens: int, capacity_blocks: int) -> None:
        self.model = model
        self.block_size_tokens = block_size_tokens
        self.capacity_blocks = capacity_blocks
        self._known: OrderedDict[EngineHash, _Known] = OrderedDict()

    def __len__(self) -> int:
        return len(self._known)

    def clear(self) -> None:
        self._known.clear()

    def gateway_keys(self, engine_hash: EngineHash) -> tuple[int, ...] | None:
        known = self._known.get(engine_hash)
        return None if known is None else known.keys

    def stored(self, event: BlockStored) -> Stored:
        tier = tier_of(event.medium)
        if tier is None:
            return Stored(None, skipped=Skip.MEDIUM)
        if event.group_idx not in (None, 0):
            return Stored(tier, skipped=Skip.GROUP)
        bs = self.block_size_tokens
        n = len(event.block_hashes)
        if n == 0 or event.block_size % bs or len(event.token_ids) != n * event.block_size:
            return Stored(tier, skipped=Skip.BLOCK_SIZE)
        if event.lora_name is not None:
            return Stored(tier, skipped=Skip.EXTRA_KEYS)
        seed: int | None
        if event.parent_block_hash is None:
            seed = root_seed(precise_namespace(self.model, root_salt(event)))
        else:
            parent = self._known.get(event.parent_block_hash)
            seed = None if parent is None else parent.keys[-1]
        out = Stored(tier)
        extra = event.extra_keys or ()
        for i, engine_hash in enumerate(event.block_hashes):
            known = self._known.get(engine_hash)  # e.g. a GPU block now copied to CPU
            if known is None:
                root = i == 0 and event.parent_block_hash is None
                if not _plain_text_keys(extra[i] if i < len(extra) else None, salt_allowed=root):
                    out.skipped = Skip.EXTRA_KEYS
                    break
                if seed is None:
                    out.skipped = Skip.ORPHAN
                    break
                tokens = event.token_ids[i * event.block_size : (i + 1) * event.block_size]
                keys = tuple(chain_token_blocks(list(tokens), block_size_tokens=bs, seed=seed))
                known = self._known[engine_hash] = _Known(keys, set())
            known.media.add(tier)
            self._known.move_to_end(engine_hash)
            out.keys.extend(known.keys)
            seed = known.keys[-1]
        while len(self._known) > self.capacity_blocks:
            self._known.popitem(last=False)
        return out

    def removed(self, event: BlockRemoved) -> tuple[Tier | None, list[int]]:
        """The tier and gateway keys to evict; unknown engine hashes are ignored."""
        tier = tier_of(event.medium)
        if tier is None or event.group_idx not in (None, 0):
            return tier, []
        keys: list[int] = []
        for engine_hash in event.block_hashes:
            known = self._known.get(engine_hash)
            if known is None:
                continue
            keys.extend(known.keys)
            known.media.discard(tier)
            if not known.media:
                del self._known[engine_hash]
        return tier, keys


# ---------------------------------------------------------------- sequence numbers


class SeqVerdict(StrEnum):
    APPLY = "apply"  # the next batch
    GAP = "gap"  # batches [expected, seq) are missing: replay them, or resync
    RESTART = "restart"  # the sequence went backwards: a new engine process; resync


@dataclass(slots=True)
class SeqTracker:
    """Expects 0, 1, 2, ... from one engine process; says what a received seq means."""

    expected: int = 0

    def check(self, seq: int) -> SeqVerdict:
        if seq == self.expected:
            return SeqVerdict.APPLY
        return SeqVerdict.GAP if seq > self.expected else SeqVerdict.RESTART

    def applied(self, seq: int) -> None:
        self.expected = seq + 1

    def restart(self) -> None:
        self.expected = 0
