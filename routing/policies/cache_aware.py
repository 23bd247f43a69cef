"""cache_aware: the cost model (routing/cost.py) on every candidate; the lowest estimated TTFT
wins. Estimates within NEAR_TIE of the best are ties, broken by fewer in-flight requests, then by
rng. Queueing is in the estimate, so a replica that holds the prefix but has a long prefill queue
loses to a cold idle one: one shared system prompt does not pile every request onto one replica.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from routing.policies.base import Candidate, Decision, Policy, Reason, RouteRequest, Score

NEAR_TIE_S = 0.002
NEAR_TIE_FRACTION = 0.05
# Estimates within max(2 ms, 5%) of the best are treated as equal: below the resolution of the
# cost model's rates (prefill throughput varies by more than 5% with batch composition).


class CacheAware:
    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        scores: tuple[Score, ...],
        *,
        seq: int,
        rng: random.Random,
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
        reason = _reason(chosen, scores)
        ranking = tuple(s.replica for s in ordered)
        return Decision(Policy.CACHE_AWARE, chosen.replica, reason, ranking, scores)


def _reason(chosen: Score, scores: tuple[Score, ...]) -> Reason:
    """Why the chosen replica won: what its estimate reuses, or that the most cached one queued."""
    most_cached = max(s.expected_cached_tokens for s in scores)
    if most_cached == 0:
        return Reason.COLD
    if chosen.expected_cached_tokens < most_cached and chosen.estimate.queue_s < min(
        s.estimate.queue_s for s in scores if s.expected_cached_tokens == most_cached
    ):
        return Reason.QUEUE
    if chosen.estimate.remote_fetch:
        return Reason.REMOTE_HIT
    if chosen.overlap.cpu_tokens:
        return Reason.CPU_HIT
    if chosen.overlap.hbm_tokens:
        return Reason.HBM_HIT
    return Reason.COLD
