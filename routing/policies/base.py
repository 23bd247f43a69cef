"""What a routing policy sees and returns, and the base every policy extends.

decide() (routing/decide.py) scores every candidate (its overlap with the prompt, the cost model's
estimate) and hands the request, the candidates and their scores to the configured policy, which
orders the candidates and says why. A policy is pure: same inputs and rng state, same Decision.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, NamedTuple

from routing.cost import CostTerms, Estimate, Load, Overlap, PoolCosts


class Policy(StrEnum):
    """The policy names a config may give (`routing.policy`); each has one module in this package
    and one entry in the registry (routing/policies/__init__.py)."""

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
    engine_priority: bool = False  # its engines schedule the prefill by the request's priority


@dataclass(frozen=True, slots=True)
class Candidate:
    """A replica that may serve the request, with a snapshot of its load."""

    name: str
    load: Load = field(default_factory=Load)
    costs: PoolCosts = field(default_factory=PoolCosts)
    remote_tier: str | None = None  # remote tier this replica's pool reads, if any
    terms: CostTerms | None = None  # learned costs (routing/learn.py); None: the seed of `costs`
    pool: PoolRules = field(default_factory=PoolRules)
    # its estimates' typical recent miss, a share of the estimate (routing/authority.py: the
    # decision leans on a robust cost as far as it is wide); None: the model's word is final
    # (the what-if replay, which replays the model itself)
    estimate_band: float | None = None


@dataclass(frozen=True, slots=True)
class RouteRequest:
    hashes: Sequence[int]
    prompt_tokens: int
    block_size_tokens: int
    priority: int = 0  # the engine priority it carries where its pool schedules by priority


class Score(NamedTuple):  # a tuple: one per candidate per request (see routing/cost.py Overlap)
    replica: str
    overlap: Overlap
    estimate: Estimate

    @property
    def expected_cached_tokens(self) -> int:
        o, e = self.overlap, self.estimate
        return o.hbm_tokens + o.cpu_tokens + (o.remote_tokens if e.remote_fetch else 0)

    def loaded_blocks(self, block_size_tokens: int) -> slice | None:
        """The prompt's blocks the request loads from the CPU or remote tier (those after its HBM
        prefix, a partial last block included); None when it loads none."""
        o = self.overlap
        fetched = o.remote_tokens if self.estimate.remote_fetch else 0
        return _after_hbm(o.hbm_tokens, o.cpu_tokens + fetched, block_size_tokens)

    def swapped_blocks(self, block_size_tokens: int) -> slice | None:
        """The prompt's blocks the request swaps in from the CPU tier; None when none."""
        o = self.overlap
        return _after_hbm(o.hbm_tokens, o.cpu_tokens, block_size_tokens)


def _after_hbm(hbm_tokens: int, tokens: int, block_size_tokens: int) -> slice | None:
    """The blocks of the `tokens` that follow an HBM prefix of `hbm_tokens`; None for none."""
    if not tokens:
        return None
    return slice(hbm_tokens // block_size_tokens, -(-(hbm_tokens + tokens) // block_size_tokens))


@dataclass(frozen=True, slots=True)
class Decision:
    policy: Policy
    replica: str
    reason: Reason
    ranking: tuple[str, ...]  # chosen first, then the fallbacks in order
    scores: tuple[Score, ...] = field(repr=False)
    # what the scores were made from (each one's load snapshot): the fit re-derives a request's
    # features from it (gateway/accounting/calibration.py)
    candidates: Sequence[Candidate] = field(repr=False, default=())

    def score(self, replica: str | None = None) -> Score:
        name = self.replica if replica is None else replica
        return next(s for s in self.scores if s.replica == name)

    def candidate(self, replica: str) -> Candidate | None:
        return next((c for c in self.candidates if c.name == replica), None)

    @property
    def est_ttft_s(self) -> float:
        return self.score().estimate.ttft_s

    @property
    def expected_cached_tokens(self) -> int:
        return self.score().expected_cached_tokens


@dataclass(frozen=True, slots=True)
class Choice:
    """What one choice starts from: the request, the candidates (at least one), every candidate's
    overlap and estimate in the candidates' order, the caller's request counter, and the caller's
    generator, the only randomness a policy may use (so a seeded gateway or benchmark repeats its
    choices)."""

    request: RouteRequest
    candidates: Sequence[Candidate]
    scores: tuple[Score, ...]
    seq: int
    rng: random.Random


class RoutingPolicy(ABC):
    """The base of every policy: a subclass names its `policy` and implements `rank`, which orders
    the candidates and says why; `choose` wraps that in the Decision, whose scores are the ones
    given, unchanged."""

    policy: ClassVar[Policy]

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        scores: tuple[Score, ...],
        *,
        seq: int,
        rng: random.Random,
    ) -> Decision:
        ranking, reason = self.rank(Choice(request, candidates, scores, seq, rng))
        return Decision(self.policy, ranking[0], reason, ranking, scores, candidates)

    @abstractmethod
    def rank(self, choice: Choice) -> tuple[tuple[str, ...], Reason]:
        """The candidates' names, chosen first then the fallbacks in order, and why the first."""
