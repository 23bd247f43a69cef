"""Where the cost of offloading lands: per-request attribution, sliding windows, a remote ledger.

Pure: no IO, no clock (every call takes `now_s`). The gateway's edge (gateway/accounting/ledger.py)
feeds it from each answered request and serves it as metrics and GET /debug/costs; `cachelane
report` (gateway/cli/report.py) and any other reader use the names below.

Public API
----------
  CostKey(tenant, tenant_class, pool)         what a row of the accounting is about
  FIELDS                                      the summed quantities of a row, in order (below)
  TierTokens, confirmed_tokens(...)           a prompt's split by tier, as the engine confirmed it
  Layers, repriced_layers(...), attribute_ttft(...)
                                              an observed TTFT split into fixed / queue / swap /
                                              fetch / prefill seconds
  request_fields(...)                         one answered request -> {field: value} to add
  Windows(bucket_s, span_s, max_keys)         time-bucketed ring of sums per key; add(), totals()
  RemoteLedger(capacity_blocks, block_bytes)  which remote-tier blocks were written, read, and
                                              evicted unread; write(), read(), resident_unread()
  WINDOWS_S                                   the windows /debug/costs reports (60, 900, 3600 s)

Fields (per CostKey, summed over a window; seconds, tokens, bytes, counts):
  requests             answered requests (status < 400)
  timed_requests       of those, streamed ones with an observed TTFT (only they are attributed)
  observed_ttft_s      sum of their observed TTFTs
  est_ttft_s           sum of the decision's estimated TTFTs (same requests)
  est_queue_s          sum of the estimate's queue term (same requests)
  fixed_s queue_s swap_s fetch_s prefill_s
                       the observed TTFT attributed to each layer (attribute_ttft); they sum to
                       observed_ttft_s
  prompt_tokens        prompt tokens (the engine's count when it reported usage)
  cached_tokens        of those, served from a cache, as the engine reported (else as expected)
  hbm_tokens cpu_tokens remote_tokens computed_tokens
                       the prompt by where its KV came from (confirmed_tokens)
  pcie_bytes           KV bytes swapped in over PCIe (cpu_tokens x KV bytes per token)
  swap_ins             requests that swapped in from the CPU tier
  swap_link_sharers    sum over those of the swap-ins on the link at once (itself included):
                       / swap_ins = mean swap-ins sharing the link
  shared_swap_ins      swap-ins that shared the link with at least one other
  remote_written_bytes KV bytes newly written to the remote tier (blocks it did not hold)
  remote_read_bytes    KV bytes fetched from the remote tier (remote hits served)
  remote_evicted_bytes bytes this key wrote that left the remote tier
  remote_never_read_bytes
                       of those, bytes never read between their write and their eviction
                       (counted against the writer, when the eviction happens)
  avoided_hbm_s avoided_cpu_s avoided_remote_s
                       prefill GPU-seconds the hits in each tier avoided: tokens hit x the
                       replica's fitted seconds per prefill token
  hbm_inserted_blocks  blocks this request put into HBM (everything but its HBM hit): the
                       churn it causes once HBM is full
  hbm_evicted_blocks   blocks that left HBM (pool rows only: an eviction has no tenant)

How a TTFT is attributed (attribute_ttft)
-----------------------------------------
The decision's estimate (the x-cachelane-est-terms-ms header's terms) is first recomputed on the
tokens the engine confirmed: its `cached_tokens` moves tokens the decision expected in a tier to
"computed" (or the other way), and the swap, fetch and prefill terms are re-priced at the
replica's cost terms in use (fitted per replica from observed TTFTs, routing/learn.py); the
fixed overhead and the queue stay as estimated. Every term is then scaled by observed / (their
sum), so the layers keep the estimate's proportions and sum to the observed TTFT.

Why proportional: the other natural rule, "the queue is the residual" (work terms as priced, the
queue = observed - work), was measured against the simulator's own per-request queue time
(loadtest/bench/costs.py, docs/costs.md): it put 3-12x the simulator's queue time in the queue
and missed it by 8-28 ms per request (every unmodelled delay, the host's event-loop lag
included, lands there), where the proportional rule gave 0.3-1.0x and 0.5-9 ms. The limit: a
queue the gateway did not foresee (work sent by other gateways) shows in proportion in every
layer, not in the queue; cachelane_ttft_estimate_error_ratio says how large the estimate's
misses are.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from routing.cost import CostTerms, Estimate, Overlap, PoolCosts

LAYERS = ("fixed", "queue", "swap", "fetch", "prefill")
TIERS = ("hbm", "cpu", "remote")

FIELDS = (
    "requests",
    "timed_requests",
    "observed_ttft_s",
    "est_ttft_s",
    "est_queue_s",
    "fixed_s",
    "queue_s",
    "swap_s",
    "fetch_s",
    "prefill_s",
    "prompt_tokens",
    "cached_tokens",
    "hbm_tokens",
    "cpu_tokens",
    "remote_tokens",
    "computed_tokens",
    "pcie_bytes",
    "swap_ins",
    "swap_link_sharers",
    "shared_swap_ins",
    "remote_written_bytes",
    "remote_read_bytes",
    "remote_evicted_bytes",
    "remote_never_read_bytes",
    "avoided_hbm_s",
    "avoided_cpu_s",
    "avoided_remote_s",
    "hbm_inserted_blocks",
    "hbm_evicted_blocks",
)
_INDEX = {name: i for i, name in enumerate(FIELDS)}

WINDOWS_S = (60.0, 900.0, 3600.0)  # 1 min, 15 min, 1 h: what /debug/costs reports

BUCKET_S = 10.0
# A window slides in steps of 10 s: a 1-minute window is 6 buckets (its oldest partly expired, so
# it covers 50-60 s), 1 h is 360 buckets. Memory: buckets x active keys x len(FIELDS) floats.
SPAN_S = 3600.0  # the longest window kept

MAX_KEYS = 512
# Distinct (tenant, class, pool) rows kept; a new key past it is counted as tenant "other" of its
# class and pool, so label cardinality and memory stay bounded whatever tenants the admin API adds.
OTHER_TENANT = "other"

MAX_TRACKED_BLOCKS = 1 << 16
# The remote ledger tracks at most 65,536 blocks (~10 MB of Python objects). A tier of more blocks
# is sampled by hash (a block is tracked when hash % rate == 0, rate = ceil(capacity / this)),
# and the sample's counts are scaled by the rate: spatial sampling as in SHARDS (Waldspurger et
# al., "Efficient MRC Construction with SHARDS", FAST 2015), which keeps an LRU's hit and
# eviction counts within a few percent at 1% sampling. The hashes are xxh3 digests, so a hash
# residue is a uniform sample. The bound is also the ledger's time, which is linear in the blocks
# it tracks: an 8k-token prompt's 512 blocks unsampled, about a tenth of them at the default
# remote tier's rate of 10 (10M tokens, gateway/config/pools.py RemoteTierConfig).


class CostKey(NamedTuple):
    tenant: str
    tenant_class: str
    pool: str


@dataclass(frozen=True, slots=True)
class TierTokens:
    """A prompt's tokens by where their KV came from."""

    hbm: int
    cpu: int  # swapped in over PCIe
    remote: int  # fetched from the remote tier
    computed: int  # prefilled (including remote-held tokens recomputed because that was cheaper)

    @property
    def cached(self) -> int:
        return self.hbm + self.cpu + self.remote


def confirmed_tokens(overlap: Overlap, remote_fetch: bool, cached_tokens: int | None) -> TierTokens:
    """The decision's expected split, corrected by what the engine says it reused.

    Fewer cached than expected: the shortfall was prefilled, taken from the remote part first,
    then the CPU part, then HBM (the farther a tier, the likelier its index entry is stale: the
    same order as the cost fit's samples, gateway/accounting/calibration.py). More than expected:
    first the remote-held tokens the decision expected recomputed (the engine weighs fetch against
    recompute on its own costs, the decision on the replica's fitted terms, so a close call goes
    either way: in the cost bench's trace every such surplus was a fetch), then HBM (another
    request prefilled it in the meantime, as vLLM's scheduler reuses)."""
    hbm, cpu = overlap.hbm_tokens, overlap.cpu_tokens
    remote = overlap.remote_tokens if remote_fetch else 0
    n = overlap.prompt_tokens
    if cached_tokens is not None:
        cached = max(0, min(cached_tokens, n))
        missing = hbm + cpu + remote - cached
        if missing > 0:
            for_remote = min(missing, remote)
            remote -= for_remote
            missing -= for_remote
            for_cpu = min(missing, cpu)
            cpu -= for_cpu
            hbm -= missing - for_cpu
        elif missing < 0:
            fetched = min(-missing, overlap.remote_tokens - remote)
            remote += fetched
            hbm += -missing - fetched
    return TierTokens(hbm, cpu, remote, n - hbm - cpu - remote)


@dataclass(frozen=True, slots=True)
class Layers:
    """An observed TTFT split into layers (seconds); they sum to the observation."""

    fixed_s: float
    queue_s: float
    swap_s: float
    fetch_s: float
    prefill_s: float

    @property
    def total_s(self) -> float:
        return self.fixed_s + self.queue_s + self.swap_s + self.fetch_s + self.prefill_s


def repriced_layers(
    tokens: TierTokens,
    terms: CostTerms,
    costs: PoolCosts,
    swap_share: float,
    queue_s: float,
    shared_s: float = 0.0,
) -> Layers:
    """The estimate's terms re-priced on `tokens`: the fixed overhead, the queue as estimated
    (`queue_s`), the swap-in (with `swap_share` = 1 + swap-ins sharing the link), the fetch and
    the prefill (its tokens, and `shared_s` as estimated: its engine steps' fixed costs and the
    tokens of others sharing them)."""
    fetch_s = costs.remote_fixed_s + tokens.remote * terms.fetch_s_per_token if tokens.remote else 0
    return Layers(
        fixed_s=terms.fixed_s,
        queue_s=queue_s,
        swap_s=tokens.cpu * swap_share * terms.swap_s_per_token,
        fetch_s=fetch_s,
        prefill_s=tokens.computed * terms.prefill_s_per_token + shared_s,
    )


def attribute_ttft(estimated: Layers, observed_s: float) -> Layers:
    """Scale the estimated layers to sum to the observed TTFT (module docstring); an estimate of
    nothing leaves it all to the fixed overhead."""
    observed_s = max(0.0, observed_s)
    total = estimated.total_s
    if total <= 0:
        return Layers(observed_s, 0.0, 0.0, 0.0, 0.0)
    f = observed_s / total
    e = estimated
    return Layers(e.fixed_s * f, e.queue_s * f, e.swap_s * f, e.fetch_s * f, e.prefill_s * f)


def swap_share_of(overlap: Overlap, estimate: Estimate) -> float:
    """1 + the swap-ins that shared the PCIe link with this one when it was sent."""
    return estimate.swap_tokens / overlap.cpu_tokens if overlap.cpu_tokens else 1.0


def request_fields(
    overlap: Overlap,
    estimate: Estimate,
    terms: CostTerms,
    costs: PoolCosts,
    *,
    block_size_tokens: int,
    observed_s: float | None,
    cached_tokens: int | None,
    prompt_tokens: int | None = None,
) -> dict[str, float]:
    """What one answered request adds to its row: tokens by tier, PCIe bytes, GPU-seconds
    avoided and, when `observed_s` (a streamed TTFT) is given, the attributed layers.

    `overlap`, `estimate`: the decision's score on the replica that answered; `terms`: the
    replica's cost terms in use; `cached_tokens`, `prompt_tokens`: the engine's usage, if it
    reported it (the engine's prompt count replaces the gateway's approximate one)."""
    if prompt_tokens is not None and prompt_tokens != overlap.prompt_tokens:
        overlap = _resized(overlap, prompt_tokens)
    tokens = confirmed_tokens(overlap, estimate.remote_fetch, cached_tokens)
    share = swap_share_of(overlap, estimate)
    per_token = terms.prefill_s_per_token
    prompt_blocks = overlap.prompt_tokens // block_size_tokens
    out: dict[str, float] = {
        "requests": 1,
        "prompt_tokens": overlap.prompt_tokens,
        "cached_tokens": tokens.cached,
        "hbm_tokens": tokens.hbm,
        "cpu_tokens": tokens.cpu,
        "remote_tokens": tokens.remote,
        "computed_tokens": tokens.computed,
        "pcie_bytes": tokens.cpu * costs.kv_bytes_per_token,
        "remote_read_bytes": tokens.remote * costs.kv_bytes_per_token,
        "avoided_hbm_s": tokens.hbm * per_token,
        "avoided_cpu_s": tokens.cpu * per_token,
        "avoided_remote_s": tokens.remote * per_token,
        "hbm_inserted_blocks": max(0, prompt_blocks - tokens.hbm // block_size_tokens),
    }
    if tokens.cpu:
        out["swap_ins"] = 1
        out["swap_link_sharers"] = share
        out["shared_swap_ins"] = 1 if share > 1 else 0
    if observed_s is not None:
        shared_s = estimate.prefill_s - estimate.own_s
        priced = repriced_layers(tokens, terms, costs, share, estimate.queue_s, shared_s)
        layers = attribute_ttft(priced, observed_s)
        out |= {
            "timed_requests": 1,
            "observed_ttft_s": observed_s,
            "est_ttft_s": estimate.ttft_s,
            "est_queue_s": estimate.queue_s,
            "fixed_s": layers.fixed_s,
            "queue_s": layers.queue_s,
            "swap_s": layers.swap_s,
            "fetch_s": layers.fetch_s,
            "prefill_s": layers.prefill_s,
        }
    return out


def _resized(overlap: Overlap, prompt_tokens: int) -> Overlap:
    """The overlap of a prompt the engine counted at `prompt_tokens` (the gateway's count is
    approximate): the cached parts are kept, capped by the new length."""
    hbm = min(overlap.hbm_tokens, prompt_tokens)
    cpu = min(overlap.cpu_tokens, prompt_tokens - hbm)
    remote = min(overlap.remote_tokens, prompt_tokens - hbm - cpu)
    return Overlap(prompt_tokens, hbm, cpu, remote)


class Windows:
    """Sums of FIELDS per key over sliding windows: a ring of `span_s / bucket_s` buckets, each
    holding the sums of the keys that had traffic in it. A window of W seconds covers the
    buckets that started within the last W (between W - bucket_s and W of history)."""

    def __init__(
        self, bucket_s: float = BUCKET_S, span_s: float = SPAN_S, max_keys: int = MAX_KEYS
    ) -> None:
        if bucket_s <= 0 or span_s < bucket_s:
            raise ValueError("need 0 < bucket_s <= span_s")
        self.bucket_s = bucket_s
        self.span_s = span_s
        self._n = math.ceil(span_s / bucket_s)
        self._max_keys = max_keys
        self._ids: list[int] = [-1] * self._n  # the bucket number each slot holds
        self._sums: list[dict[Hashable, list[float]]] = [{} for _ in range(self._n)]
        self._keys: set[Hashable] = set()

    def key_of(self, key: CostKey) -> CostKey:
        """`key`, or its tenant "other" row once MAX_KEYS keys are in use."""
        if key in self._keys or len(self._keys) < self._max_keys:
            return key
        return CostKey(OTHER_TENANT, key.tenant_class, key.pool)

    def add(self, now_s: float, key: Hashable, values: Mapping[str, float]) -> None:
        if isinstance(key, CostKey):
            key = self.key_of(key)
        bucket = int(now_s // self.bucket_s)
        slot = bucket % self._n
        if self._ids[slot] != bucket:
            self._ids[slot] = bucket
            self._sums[slot] = {}
        self._keys.add(key)
        row = self._sums[slot].get(key)
        if row is None:
            row = self._sums[slot][key] = [0.0] * len(FIELDS)
        for name, value in values.items():
            row[_INDEX[name]] += value

    def totals(self, now_s: float, window_s: float) -> dict[Hashable, dict[str, float]]:
        """{key: {field: sum}} over the last `window_s` (at most span_s), keys with traffic only."""
        newest = int(now_s // self.bucket_s)
        count = min(self._n, max(1, math.ceil(window_s / self.bucket_s)))
        acc: dict[Hashable, list[float]] = {}
        for bucket in range(newest - count + 1, newest + 1):
            slot = bucket % self._n
            if self._ids[slot] != bucket:
                continue
            for key, row in self._sums[slot].items():
                into = acc.setdefault(key, [0.0] * len(FIELDS))
                for i, v in enumerate(row):
                    into[i] += v
        return {key: dict(zip(FIELDS, row, strict=True)) for key, row in acc.items()}

    def forget_idle_keys(self, now_s: float) -> None:
        """Free the key slots of keys with no traffic within span_s."""
        newest = int(now_s // self.bucket_s)
        live: set[Hashable] = set()
        for slot, bucket in enumerate(self._ids):
            if newest - self._n < bucket <= newest:
                live |= set(self._sums[slot])
        self._keys &= live


@dataclass(frozen=True, slots=True)
class Eviction:
    """Blocks one writer lost from the remote tier, in bytes."""

    evicted_bytes: float
    never_read_bytes: float


@dataclass(slots=True)
class _Block:
    writer: CostKey
    read: bool = False  # since it was written


class RemoteLedger:
    """The gateway's model of one remote tier: an LRU of its blocks at the tier's capacity, each
    with who wrote it and whether it was read since. Writes insert a prompt's blocks (its prefix
    the most recent, as the tier stores them), reads refresh the blocks fetched, as an LRU tier
    (LMCache's default eviction policy; the simulator's tier) does; a block pushed out unread is
    "written, never read".

    This is an estimate of the tier, not its state: the tier's own evictions are not reported
    to the gateway (LMCache publishes no eviction events), a write the engine dropped or a
    block another gateway wrote or read is not seen, and the capacity is the configured one."""

    def __init__(
        self, capacity_blocks: int, block_bytes: int, max_tracked: int = MAX_TRACKED_BLOCKS
    ) -> None:
        self.rate = max(1, math.ceil(capacity_blocks / max_tracked))
        self.capacity = max(1, capacity_blocks // self.rate)
        self.block_bytes = block_bytes
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._blocks)

    def _tracked(self, hashes: Iterable[int]) -> list[int]:
        r = self.rate
        return [h for h in hashes if h % r == 0] if r > 1 else list(hashes)

    def write(
        self, hashes: Sequence[int], writer: CostKey
    ) -> tuple[float, dict[CostKey, Eviction]]:
        """A prompt's blocks written: (bytes newly written, {writer: bytes it lost to eviction})."""
        new = 0
        for h in self._tracked(reversed(hashes)):
            entry = self._blocks.get(h)
            if entry is None:
                self._blocks[h] = _Block(writer)
                new += 1
            else:
                self._blocks.move_to_end(h)
        lost: dict[CostKey, list[float]] = {}
        while len(self._blocks) > self.capacity:
            _, block = self._blocks.popitem(last=False)
            row = lost.setdefault(block.writer, [0.0, 0.0])
            row[0] += self.block_bytes * self.rate
            if not block.read:
                row[1] += self.block_bytes * self.rate
        evictions = {k: Eviction(v[0], v[1]) for k, v in lost.items()}
        return new * self.block_bytes * self.rate, evictions

    def read(self, hashes: Sequence[int], *, fetched: bool = True) -> float:
        """Blocks a request found in the tier (its remote-held run): refreshed; when `fetched`
        (not recomputed) marked read. Returns the bytes read, per the ledger."""
        found = 0
        for h in self._tracked(reversed(hashes)):
            entry = self._blocks.get(h)
            if entry is None:
                continue
            self._blocks.move_to_end(h)
            if fetched:
                entry.read = True
                found += 1
        return found * self.block_bytes * self.rate

    def resident_unread(self) -> dict[CostKey, float]:
        """Bytes each writer has in the tier that nobody read yet (not final: they may be)."""
        out: dict[CostKey, float] = {}
        for block in self._blocks.values():
            if not block.read:
                out[block.writer] = out.get(block.writer, 0.0) + self.block_bytes * self.rate
        return out
