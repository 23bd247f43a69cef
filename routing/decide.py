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

from routing.cost import Overlap, estimate
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
    scores = tuple(
        Score(c.name, ov, estimate(ov, c.load, c.costs, c.terms))
        for c in candidates
        for ov in (overlap_of(c, runs, request),)
    )
    return POLICIES[policy].choose(request, candidates, scores, seq=seq, rng=rng)
