"""cache_aware: the cost model (routing/cost.py) on every candidate; the lowest cost wins: the
estimated TTFT, plus the wait the request adds to others (OVERTAKE_WEIGHT): where the engine
schedules by priority, the less urgent requests it would overtake; everywhere, the requests still
loading their KV (swap-in, remote fetch) that would join the queue while it prefills. Costs
within NEAR_TIE of the best are ties, broken by fewer in-flight requests, then by rng. Queueing
is in the estimate, so a replica that holds the prefix but has a long prefill queue loses to a
cold idle one: one shared system prompt does not pile every request onto one replica.

The estimate decides only as far as it has been right (routing/authority.py): a candidate's cost
is the model's blended with a robust one (the tokens it would prefill, its own uncached and the
prefills already sent there, at its prefill rate) by the doubt its recent misses earn.
"""

from __future__ import annotations

from routing.authority import doubt_of, robust_s
from routing.policies.base import Candidate, Choice, Policy, Reason, RoutingPolicy, Score

NEAR_TIE_S = 0.002
NEAR_TIE_FRACTION = 0.05
# Estimates within max(2 ms, 5%) of the best are treated as equal: below the resolution of the
# cost model's rates (prefill throughput varies by more than 5% with batch composition).

OVERTAKE_WEIGHT = 1.0
# Each request overtaken waits the overtaker's prefill longer; that second counts like one of the
# overtaker's own. Without it the choice is greedy: an urgent request jumps a busy replica's queue
# to save itself a few ms over an idle replica, and each request it passes pays its whole prefill
# (python -m loadtest.bench.critical shows it in the standard class's p99; docs/critical.md).
# With it an urgent request still overtakes where that saves more than it costs the others. A
# request that takes a free prefill while another is still fetching its KV is the same case with
# arrival order: the fetching request then waits for a prefill that started during its fetch,
# which its own estimate could not know of (python -m loadtest.bench.estimate shows these misses
# on a slow tiered fleet; docs/bench/estimate.md).


class CacheAware(RoutingPolicy):
    policy = Policy.CACHE_AWARE

    def rank(self, choice: Choice) -> tuple[tuple[str, ...], Reason]:
        candidates, scores = choice.candidates, choice.scores
        # scores are in the candidates' order
        costs = [cost_s(s, c) for s, c in zip(scores, candidates, strict=True)]
        best_s = min(costs)
        tie_s = best_s + max(NEAR_TIE_S, NEAR_TIE_FRACTION * best_s)
        rand = choice.rng.random
        # rank: the cost, where near-ties count as the best, then fewer in flight, then rng
        keys = [
            (best_s if cost <= tie_s else cost, c.load.in_flight, rand(), i)
            for i, (cost, c) in enumerate(zip(costs, candidates, strict=True))
        ]
        keys.sort()
        ordered = [scores[k[3]] for k in keys]
        return tuple(s.replica for s in ordered), _reason(ordered[0], scores)


def cost_s(s: Score, c: Candidate | None = None) -> float:
    """What placing the request there costs: its estimated TTFT, and the wait it adds to the
    requests it would go before: the less urgent ones it overtakes, and those still loading
    their KV that would join the queue while it prefills. Blended with the robust cost by the
    doubt in `c`'s estimates (routing/authority.py); without `c`, the model's cost alone."""
    e = s.estimate
    model_s = e.ttft_s + OVERTAKE_WEIGHT * e.others_wait_s
    if c is None or c.estimate_band is None:
        return model_s
    doubt = doubt_of(c.estimate_band)
    if not doubt:
        return model_s
    return (1 - doubt) * model_s + doubt * robust_s(s, c)


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
