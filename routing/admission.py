"""Remote-tier admission: write a prompt's KV to the remote tier only when reuse will pay for it.

A prefix family is keyed by the hash of the prompt's first FAMILY_BLOCKS blocks (the chain makes
that hash identify the whole leading 64 tokens). Its expected reuse is the number of earlier
requests of the same family seen within the window: a family seen k times recently is expected
about k more times. Writing n new tokens costs one network transfer; each future reuse saves
recomputing the prefix minus fetching it back:

    write  iff  expected_reuse * max(0, recompute_s(s) - fetch_s(s)) > write_s(n_new)

where s is the part of the prompt that earlier requests shared (the leading blocks some location
holds, per the index): a family's count says the first blocks come back, the index says how far
the shared part goes. Unique prompts (k = 0) are never written, nor are one-off prompts behind a
common short instruction (s too short for a fetch to pay); long prefixes of busy families are.
A prefix evicted everywhere before it comes back is not seen as shared (a missed write, never a
wasted one).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from routing.cost import CostTerms, PoolCosts, seeded

FAMILY_BLOCKS = 4
# Same prefix key as prefix_hash (PREFIX_KEY_BLOCKS, routing/policies/prefix_hash.py): 64 tokens
# at block size 16 separate system prompts and documents without splitting one conversation into
# several families.

DEFAULT_WINDOW_S = 300.0
# 5 minutes: a chat or agent session's turns arrive within seconds to minutes of each other; a
# family not seen for 5 minutes is treated as cold again.

WINDOW_BUCKETS = 10  # the window slides in steps of window_s / 10
MAX_FAMILIES = 100_000  # ~10 MB of counters; the least recently seen family is forgotten first


def family_key(hashes: Sequence[int]) -> int | None:
    if not hashes:
        return None
    return hashes[min(FAMILY_BLOCKS, len(hashes)) - 1]


@dataclass(frozen=True, slots=True)
class AdmissionVerdict:
    write: bool
    expected_reuse: float
    gain_s: float  # time saved over the expected reuses
    cost_s: float  # network time of the write
    new_tokens: int  # tokens the remote tier does not hold yet


def transfer_s(tokens: int, costs: PoolCosts, terms: CostTerms | None = None) -> float:
    """One transfer of `tokens` to or from the remote tier: its fixed cost (configured) and the
    per-token fetch time (`terms`, learned; default: the seed of `costs`)."""
    t = terms if terms is not None else seeded(costs)
    return costs.remote_fixed_s + tokens * t.fetch_s_per_token


def should_write(
    prompt_tokens: int,
    remote_tokens: int,
    shared_tokens: int,
    expected_reuse: float,
    costs: PoolCosts,
    terms: CostTerms | None = None,
) -> AdmissionVerdict:
    """`remote_tokens`: leading tokens of the prompt the remote tier already holds.
    `shared_tokens`: leading tokens earlier requests had in common with this one (held
    somewhere, per the index). Only that part has shown reuse: one-off prompts behind a common
    instruction share the instruction, not the rest, and a write of them would never be read.
    `terms`: the replica's cost terms in use (learned: routing/learn.py), so that a fleet
    slower than the defaults is priced as it is, as its estimates are; default: the seed."""
    new_tokens = max(0, prompt_tokens - remote_tokens)
    if new_tokens == 0:
        return AdmissionVerdict(False, expected_reuse, 0.0, 0.0, 0)
    t = terms if terms is not None else seeded(costs)
    reused = min(shared_tokens, prompt_tokens)
    saved_per_reuse = reused * t.prefill_s_per_token - transfer_s(reused, costs, t)
    gain_s = expected_reuse * max(0.0, saved_per_reuse)
    cost_s = transfer_s(new_tokens, costs, t)
    return AdmissionVerdict(gain_s > cost_s, expected_reuse, gain_s, cost_s, new_tokens)


class ReuseWindow:
    """Per-family request counts over a sliding window (in memory, for one gateway)."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, max_families: int = MAX_FAMILIES):
        self._bucket_s = window_s / WINDOW_BUCKETS
        self._max_families = max_families
        # family -> {bucket index: count}
        self._counts: OrderedDict[int, dict[int, int]] = OrderedDict()

    def bucket(self, now_s: float) -> int:
        return math.floor(now_s / self._bucket_s)

    def count(self, family: int, now_s: float) -> int:
        """Requests of the family within the window, without counting a new one."""
        oldest = self.bucket(now_s) - WINDOW_BUCKETS + 1
        return sum(n for b, n in self._counts.get(family, {}).items() if b >= oldest)

    def seen(self, family: int, now_s: float) -> int:
        """Count this request; return how many earlier ones of the family are in the window."""
        bucket = self.bucket(now_s)
        oldest = bucket - WINDOW_BUCKETS + 1
        counts = self._counts.pop(family, {})
        counts = {b: n for b, n in counts.items() if b >= oldest}
        earlier = sum(counts.values())
        counts[bucket] = counts.get(bucket, 0) + 1
        self._counts[family] = counts
        while len(self._counts) > self._max_families:
            self._counts.popitem(last=False)
        return earlier
