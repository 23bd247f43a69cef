"""decide(): pick a replica for one request. Pure: same inputs and rng state, same Decision.

decide() scores every candidate (its overlap with the prompt per tier, and the cost model's TTFT
estimate, routing/cost.py), then hands the choice to the configured policy, one module each in
routing/policies/ (round_robin, least_loaded and prefix_hash are baselines to compare against;
cache_aware is the cost-model policy), looked up in the registry routing/policies/__init__.py.

Every Decision carries each candidate's overlap and estimate, the fallback order and a reason
label (a metric label, a response header, and what tests assert on).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import lru_cache
from itertools import groupby
from operator import countOf

from routing.cost import CostTerms, Overlap, estimate, seeded
from routing.hidden_tier import ANY_HOLDER
from routing.policies import POLICIES
from routing.policies.base import (
    Candidate,
    Decision,
    Policy,
    PoolRules,
    Reason,
    RouteRequest,
    Score,
)
from routing.types import BlockHits, Location, Tier

__all__ = [
    "Candidate",
    "Decision",
    "NoCandidates",
    "Policy",
    "PoolRules",
    "Reason",
    "RouteRequest",
    "Score",
    "decide",
    "leading_runs",
    "overlap_of",
    "runs_of",
]


class NoCandidates(Exception):
    """decide() was given no replica to choose from."""


Runs = list[tuple[frozenset[Location], int]]


def runs_of(hits: BlockHits) -> Runs:
    """Consecutive blocks with the same holders, as (holders, count). A shared prefix was recorded
    block by block at the same places, so a long prompt is a handful of runs, and the overlap of
    every candidate is computed per run instead of per block."""
    # groupby compares neighbours in C, by identity first (the index shares one object across a
    # run), and countOf counts a run without a Python step per block
    return [(holders, countOf(group, holders)) for holders, group in groupby(hits)]


@lru_cache(maxsize=4096)  # replicas and remote tiers: a few names, asked per candidate per request
def _location(holder: str, tier: Tier) -> Location:
    return Location(holder, tier)


Leading = dict[Location, tuple[int, int]]


def leading_runs(runs: Runs) -> Leading:
    """For every location that holds the prompt's first block: how many leading runs, and
    blocks, it holds without a gap. One pass with set operations in C, instead of a walk over
    the runs per candidate: at 16 replicas each holding a different length of one prompt that
    walk was half of decide()."""
    out: Leading = {}
    if not runs:
        return out
    alive = set(runs[0][0])
    blocks = 0
    for k, (holders, count) in enumerate(runs):
        gone = alive.difference(holders)
        if gone:
            for location in gone:
                out[location] = (k, blocks)
            alive -= gone
            if not alive:
                return out
        blocks += count
    for location in alive:
        out[location] = (len(runs), blocks)
    return out


def overlap_of(
    candidate: Candidate, runs: Runs, request: RouteRequest, leading: Leading | None = None
) -> Overlap:
    """Split the prompt into HBM prefix, CPU extension and remote extension for one replica:
    the leading runs in its HBM, then those in its HBM or CPU tier (an HBM-only pool stops
    before), then those anywhere it can load from its remote tier (a hidden tier, ANY_HOLDER:
    every run some location holds); the first run it can get from nowhere ends the overlap.
    `leading`: leading_runs(runs), when the caller has it."""
    hbm = _location(candidate.name, Tier.HBM)
    if leading is None:
        leading = leading_runs(runs)
    i, g = leading.get(hbm, (0, 0))
    end = len(runs)
    c = m = 0
    if i < end and not candidate.pool.hbm_only:
        cpu = _location(candidate.name, Tier.CPU)
        while i < end and (hbm in runs[i][0] or cpu in runs[i][0]):
            c += runs[i][1]
            i += 1
        if candidate.remote_tier == ANY_HOLDER:  # a hidden tier: whatever anyone holds
            while i < end:
                m += runs[i][1]
                i += 1
        elif candidate.remote_tier:
            remote = _location(candidate.remote_tier, Tier.REMOTE)
            while i < end and (remote in (h := runs[i][0]) or hbm in h or cpu in h):
                m += runs[i][1]
                i += 1
    b, n = request.block_size_tokens, request.prompt_tokens
    # the last block may be partly past the prompt's end (approximate token counts)
    hbm_t = g * b if g * b < n else n
    cpu_t = c * b if c * b < n - hbm_t else n - hbm_t
    remote_t = m * b if m * b < n - hbm_t - cpu_t else n - hbm_t - cpu_t
    return Overlap(n, hbm_t, cpu_t, remote_t)


def decide(
    request: RouteRequest,
    candidates: Sequence[Candidate],
    hits: BlockHits,
    policy: Policy,
    *,
    seq: int,
    rng: random.Random,
) -> Decision:
    """Choose the replica for one request among `candidates`, by `policy`.

    `request`: the prompt's block hashes, its length in tokens and the block size; `hits`: per
    leading block of the prompt, the locations that hold it (the index lookup); `seq`: the
    caller's request counter (round_robin's turn); `rng`: the caller's generator, the only
    randomness used (tie breaks), so a seeded caller repeats its decisions.

    Returns the Decision: the chosen replica, the ranking (chosen first, then the fallbacks), a
    reason label, and every candidate's overlap and estimate. Raises NoCandidates when
    `candidates` is empty, and KeyError for a policy with no entry in routing.policies.POLICIES.
    """
    if not candidates:
        raise NoCandidates("no eligible replica")
    runs = runs_of(hits)
    leading = leading_runs(runs)
    scores = []
    for c in candidates:
        ov = overlap_of(c, runs, request, leading)
        terms = c.terms if c.terms is not None else seeded(c.costs)
        priority = request.priority if c.pool.engine_priority else None
        scores.append(Score(c.name, ov, estimate(ov, c.load, c.costs, terms, priority)))
    return POLICIES[policy].choose(request, candidates, tuple(scores), seq=seq, rng=rng)


def rescored(score: Score, candidate: Candidate, terms: CostTerms, priority: int | None) -> Score:
    """`score` made again from the decision's snapshot of `candidate` with `terms`: what the
    decision would have estimated with the costs known now. The fit learns from a request's
    features (the work queued ahead, the steps it waited for) at the terms in use when it
    learns, not those of the decision: while a fleet is first learned the terms move many-fold
    within seconds, and features replayed at rates 10x too fast hide the queue a request really
    waited for. The remote tier's fetch-or-recompute choice is the one the decision made (the
    request was sent so): where the new terms would choose otherwise, `score` is kept."""
    again = estimate(score.overlap, candidate.load, candidate.costs, terms, priority)
    if again.remote_fetch != score.estimate.remote_fetch:
        return score
    return Score(score.replica, score.overlap, again)
