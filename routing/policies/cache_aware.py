"""cache_aware: the cost model (routing/cost.py) on every candidate; the lowest cost wins: the
estimated TTFT, plus the wait the request adds to others (OVERTAKE_WEIGHT): where the engine
schedules by priority, the less urgent requests it would overtake; everywhere, the requests still
loading their KV (swap-in, remote fetch) that would join the queue while it prefills. Costs
within NEAR_TIE of the best are ties, broken by fewer in-flight requests, then by rng. Queueing
is in the estimate, so a replica that holds the prefix but has a long prefill queue loses to a
cold idle one: one shared system prompt does not pile every request onto one replica.

The estimate decides only as far as it has been right (routing/authority.py): where a
candidate's recent misses span more than a near-tie, the candidates whose cost is within the
best's band (the wider of the two replicas' misses) are ordered by the robust rule instead: a
replica out of balance last, then the most tokens expected cached, then fewer in flight, then
rng; the others follow by cost.
"""

from __future__ import annotations

from routing.authority import BALANCE_SLACK
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
        costs = [cost_s(s) for s in scores]  # scores are in the candidates' order
        best = min(range(len(costs)), key=costs.__getitem__)
        best_s = costs[best]
        best_band = _band(candidates[best])
        in_band = [
            cost <= best_s + max(NEAR_TIE_S, best_s * max(best_band, _band(c)))
            for cost, c in zip(costs, candidates, strict=True)
        ]
        banded = [c for c, b in zip(candidates, in_band, strict=True) if b]
        # a model that has been right leaves only near-ties, taken by load as ever; a wider band
        # is the model's doubt, where the robust rule orders
        robust = max(_band(c) for c in banded) > NEAR_TIE_FRACTION
        least = min(c.load.in_flight for c in banded)
        bs = choice.request.block_size_tokens
        rand = choice.rng.random
        keys: list[tuple[float, ...]] = []
        for i, (cost, c, s) in enumerate(zip(costs, candidates, scores, strict=True)):
            if not in_band[i]:
                keys.append((1, cost, 0, c.load.in_flight, rand(), i))
            elif robust:  # balance, then cached blocks, then load
                over = c.load.in_flight > least + BALANCE_SLACK
                cached_blocks = s.expected_cached_tokens // max(1, bs)
                keys.append((0, over, -cached_blocks, c.load.in_flight, rand(), i))
            else:
                keys.append((0, 0, 0, c.load.in_flight, rand(), i))
        keys.sort()
        ordered = [scores[int(k[-1])] for k in keys]
        return tuple(s.replica for s in ordered), _reason(ordered[0], scores)


def _band(c: Candidate) -> float:
    """The share of the best cost within which `c`'s estimate cannot be told from it."""
    return NEAR_TIE_FRACTION if c.estimate_band is None else max(NEAR_TIE_FRACTION, c.estimate_band)


def cost_s(s: Score) -> float:
    """What placing the request there costs: its estimated TTFT, and the wait it adds to the
    requests it would go before: the less urgent ones it overtakes, and those still loading
    their KV that would join the queue while it prefills."""
    e = s.estimate
    return e.ttft_s + OVERTAKE_WEIGHT * e.others_wait_s


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
