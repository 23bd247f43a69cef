"""decide(): pick a replica for one request. Pure: same inputs and rng state, same Decision.

Policies (selectable in config, the first three are baselines to compare against):
  round_robin   replicas in turn (`seq` is the caller's request counter).
  least_loaded  fewest in-flight requests, then fewest pending prefill tokens, ties by rng.
  prefix_hash   rendezvous hashing of the prompt's first PREFIX_KEY_BLOCKS blocks, with bounded
                load: a replica above LOAD_BOUND x the mean in-flight count is skipped for the
                next one in its hash order (Mirrokni et al., "Consistent Hashing with Bounded
                Loads", 2018).
  cache_aware   the cost model (routing/cost.py) on every candidate; the lowest estimated TTFT
                wins. Estimates within NEAR_TIE of the best are ties, broken by fewer in-flight
                requests, then by rng. Queueing is in the estimate, so a replica that holds the
                prefix but has a long prefill queue loses to a cold idle one: one shared system
                prompt does not pile every request onto one replica.

Every Decision carries each candidate's overlap and estimate, the fallback order and a reason
label (a metric label, a response header, and what tests assert on).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import xxhash

from routing.cost import CostTerms, Estimate, Load, Overlap, PoolCosts, estimate
from routing.types import BlockHits, Location, Tier

PREFIX_KEY_BLOCKS = 4
# prefix_hash keys on the first 4 blocks (64 tokens at block size 16): long enough to separate
# system prompts, short enough that every turn of one conversation maps to the same key.

LOAD_BOUND = 1.25
# Bounded-load factor c = 1.25, the value Mirrokni et al. evaluate and Vimeo's production use
# of bounded-load consistent hashing (HAProxy hash-balance-factor 125).

NEAR_TIE_S = 0.002
NEAR_TIE_FRACTION = 0.05
# Estimates within max(2 ms, 5%) of the best are treated as equal: below the resolution of the
# cost model's rates (prefill throughput varies by more than 5% with batch composition).


class Policy(StrEnum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX_HASH = "prefix_hash"
    CACHE_AWARE = "cache_aware"


class Reason(StrEnum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX_HASH = "prefix_hash"
    PREFIX_HASH_SPILL = "prefix_hash_spill"  # the hashed replica was over its load bound
    HBM_HIT = "hbm_hit"  # the best estimate reuses HBM blocks
    CPU_HIT = "cpu_hit"  # ... and swaps blocks in from the CPU tier
    REMOTE_HIT = "remote_hit"  # ... and fetches blocks from the remote tier
    QUEUE = "queue"  # a replica with a longer cached prefix lost on queueing
    COLD = "cold"  # no replica holds any of the prefix: least estimated queue wins


@dataclass(frozen=True, slots=True)
class PoolRules:
    """How a replica's pool may be used (routing/filters.py applies them)."""

    name: str = "default"
    pinned: bool = False  # reserved for critical tenants
    hbm_only: bool = False  # no CPU or remote tier: no swap-in or remote term
    max_in_flight: int | None = None  # admission cap per replica
    max_prefill_tokens: int | None = None  # admission cap per replica
    lend_below: float | None = None  # standard traffic may use it below this fraction of the caps


@dataclass(frozen=True, slots=True)
class Candidate:
    """A replica that may serve the request, with a snapshot of its load."""

    name: str
    load: Load = field(default_factory=Load)
    costs: PoolCosts = field(default_factory=PoolCosts)
    remote_tier: str | None = None  # remote tier this replica's pool reads, if any
    terms: CostTerms | None = None  # learned costs (routing/learn.py); None: the seed of `costs`
    pool: PoolRules = field(default_factory=PoolRules)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    hashes: Sequence[int]
    prompt_tokens: int
    block_size_tokens: int


@dataclass(frozen=True, slots=True)
class Score:
    replica: str
    overlap: Overlap
    estimate: Estimate

    @property
    def expected_cached_tokens(self) -> int:
        o, e = self.overlap, self.estimate
        return o.hbm_tokens + o.cpu_tokens + (o.remote_tokens if e.remote_fetch else 0)


@dataclass(frozen=True, slots=True)
class Decision:
    policy: Policy
    replica: str
    reason: Reason
    ranking: tuple[str, ...]  # chosen first, then the fallbacks in order
    scores: tuple[Score, ...] = field(repr=False)

    def score(self, replica: str | None = None) -> Score:
        name = self.replica if replica is None else replica
        return next(s for s in self.scores if s.replica == name)

    @property
    def est_ttft_s(self) -> float:
        return self.score().estimate.ttft_s

    @property
    def expected_cached_tokens(self) -> int:
        return self.score().expected_cached_tokens


class NoCandidates(Exception):
    """decide() was given no replica to choose from."""


Runs = list[tuple[frozenset[Location], int]]


def runs_of(hits: BlockHits) -> Runs:
    """Consecutive blocks with the same holders, as (holders, count). A shared prefix was recorded
    block by block at the same places, so a long prompt is a handful of runs, and the overlap of
    every candidate is computed per run instead of per block."""
    runs: Runs = []
    for holders in hits:
        if runs and (holders is runs[-1][0] or holders == runs[-1][0]):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((holders, 1))
    return runs


def overlap_of(candidate: Candidate, runs: Runs, request: RouteRequest) -> Overlap:
    """Split the prompt into HBM prefix, CPU extension and remote extension for one replica."""
    hbm = Location(candidate.name, Tier.HBM)
    cpu = Location(candidate.name, Tier.CPU)
    remote = Location(candidate.remote_tier, Tier.REMOTE) if candidate.remote_tier else None
    g = c = m = 0
    for holders, count in runs:
        if hbm in holders and c == 0 and m == 0:
            g += count
        elif candidate.pool.hbm_only:
            break
        elif (hbm in holders or cpu in holders) and m == 0:
            c += count
        elif remote is not None and (remote in holders or hbm in holders or cpu in holders):
            m += count
        else:
            break
    b, n = request.block_size_tokens, request.prompt_tokens
    hbm_t = min(g * b, n)
    cpu_t = min(c * b, n - hbm_t)
    remote_t = min(m * b, n - hbm_t - cpu_t)
    return Overlap(prompt_tokens=n, hbm_tokens=hbm_t, cpu_tokens=cpu_t, remote_tokens=remote_t)


def decide(
    request: RouteRequest,
    candidates: Sequence[Candidate],
    hits: BlockHits,
    policy: Policy,
    *,
    seq: int,
    rng: random.Random,
) -> Decision:
    if not candidates:
        raise NoCandidates("no eligible replica")
    runs = runs_of(hits)
    scores = tuple(
        Score(c.name, ov, estimate(ov, c.load, c.costs, c.terms))
        for c in candidates
        for ov in (overlap_of(c, runs, request),)
    )
    if policy is Policy.ROUND_ROBIN:
        start = seq % len(candidates)
        order = [c.name for c in candidates[start:]] + [c.name for c in candidates[:start]]
        return Decision(policy, order[0], Reason.ROUND_ROBIN, tuple(order), scores)
    if policy is Policy.LEAST_LOADED:
        keyed = sorted(
            candidates,
            key=lambda c: (c.load.in_flight, c.load.pending_prefill_tokens, rng.random()),
        )
        order = [c.name for c in keyed]
        return Decision(policy, order[0], Reason.LEAST_LOADED, tuple(order), scores)
    if policy is Policy.PREFIX_HASH:
        return _prefix_hash(request, candidates, scores)
    return _cache_aware(candidates, scores, rng)


def _prefix_hash(
    request: RouteRequest, candidates: Sequence[Candidate], scores: tuple[Score, ...]
) -> Decision:
    hashes = request.hashes
    # a prompt shorter than one block has no hash; its length is the only key left
    key = hashes[min(PREFIX_KEY_BLOCKS, len(hashes)) - 1] if hashes else request.prompt_tokens
    key_bytes = key.to_bytes(8, "little")
    by_weight = sorted(
        candidates,
        key=lambda c: xxhash.xxh3_64_intdigest(
            key_bytes, seed=xxhash.xxh3_64_intdigest(c.name.encode())
        ),
        reverse=True,
    )
    total = sum(c.load.in_flight for c in candidates) + 1  # counting this request
    bound = math.ceil(LOAD_BOUND * total / len(candidates))
    within = [c for c in by_weight if c.load.in_flight + 1 <= bound]
    order = within + [c for c in by_weight if c not in within]
    reason = Reason.PREFIX_HASH if order[0] is by_weight[0] else Reason.PREFIX_HASH_SPILL
    return Decision(Policy.PREFIX_HASH, order[0].name, reason, tuple(c.name for c in order), scores)


def _cache_aware(
    candidates: Sequence[Candidate], scores: tuple[Score, ...], rng: random.Random
) -> Decision:
    in_flight = {c.name: c.load.in_flight for c in candidates}
    best_s = min(s.estimate.ttft_s for s in scores)
    tie_s = max(NEAR_TIE_S, NEAR_TIE_FRACTION * best_s)
    tiebreak = {s.replica: rng.random() for s in scores}

    def rank(s: Score) -> tuple[float, int, float]:
        near_best = s.estimate.ttft_s <= best_s + tie_s
        return (
            best_s if near_best else s.estimate.ttft_s,
            in_flight[s.replica],
            tiebreak[s.replica],
        )

    ordered = sorted(scores, key=rank)
    chosen = ordered[0]
    most_cached = max(s.expected_cached_tokens for s in scores)
    if most_cached == 0:
        reason = Reason.COLD
    elif chosen.expected_cached_tokens < most_cached and chosen.estimate.queue_s < min(
        s.estimate.queue_s for s in scores if s.expected_cached_tokens == most_cached
    ):
        reason = Reason.QUEUE
    elif chosen.estimate.remote_fetch:
        reason = Reason.REMOTE_HIT
    elif chosen.overlap.cpu_tokens:
        reason = Reason.CPU_HIT
    elif chosen.overlap.hbm_tokens:
        reason = Reason.HBM_HIT
    else:
        reason = Reason.COLD
    return Decision(
        Policy.CACHE_AWARE, chosen.replica, reason, tuple(s.replica for s in ordered), scores
    )
