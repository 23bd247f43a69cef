"""gateway/accounting/calibration.py: what the gateway learns from each observed TTFT, per mode."""

from __future__ import annotations

import random

import pytest

from gateway.accounting.calibration import (
    CORRECTION_BOUNDS,
    MIN_OWN_SAMPLES,
    CostLearner,
    Mode,
    Observation,
    sample_of,
)
from gateway.config import parse_config
from gateway.fleet.registry import Registry
from gateway.fleet.replica import Replica
from gateway.telemetry.metrics import Metrics
from routing.cost import CostTerms, Load, Overlap, PoolCosts, estimate
from routing.decide import Score, rescored
from routing.learn import MIN_EXCITED, OnlineFit
from routing.policies.base import Candidate

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
SEED = CostTerms.seed(PoolCosts())


def replicas() -> list[Replica]:
    config = parse_config({"pools": [{"name": "p", "replicas": URLS}]})
    return list(Registry(config).replicas.values())


def score_on(replica: Replica, overlap: Overlap, load: Load | None = None) -> Score:
    e = estimate(overlap, load or Load(), replica.costs, replica.terms)
    return Score(replica.name, overlap, e)


def observe(learner: CostLearner, replica: Replica, overlap: Overlap, observed_s: float) -> None:
    score = score_on(replica, overlap)
    learner.observe(Observation(replica, score, observed_s, cached_tokens=None))


def slow_ttft(overlap: Overlap, slowdown: float) -> float:
    """What a replica `slowdown` x slower than the defaults takes for this request."""
    return SEED.fixed_s + overlap.uncached_tokens * SEED.prefill_s_per_token * slowdown


def test_sample_moves_what_the_engine_did_not_reuse_to_prefilled() -> None:
    r = replicas()[0]
    overlap = Overlap(4000, hbm_tokens=1000, cpu_tokens=1000, remote_tokens=1000)
    score = score_on(r, overlap)
    assert score.estimate.remote_fetch
    expected = sample_of(score, 0.1, cached_tokens=None)
    assert (expected.uncached_tokens, expected.swapped_tokens, expected.fetched_tokens) == (
        1000,
        1000,
        1000,
    )
    # the engine reused 1,500 tokens: the fetched 1,000 and 500 of the swapped ones were computed
    less = sample_of(score, 0.1, cached_tokens=1500)
    assert (less.uncached_tokens, less.swapped_tokens, less.fetched_tokens) == (2500, 500, 0)
    # it reused more than the index knew: fewer tokens were prefilled
    more = sample_of(score, 0.1, cached_tokens=3500)
    assert more.uncached_tokens == 500


def test_remote_tokens_the_estimate_would_recompute_but_the_engine_reused_were_fetched() -> None:
    """200 remote tokens: recomputing them beats the fetch's fixed cost, so the estimate counts
    them as prefilled; the engine loaded them (cached 1,200 of 1,000 + 200 expected cached + 200
    remote): the sample has them fetched, not free."""
    r = replicas()[0]
    overlap = Overlap(2000, hbm_tokens=1000, remote_tokens=200)
    score = score_on(r, overlap)
    assert not score.estimate.remote_fetch
    s = sample_of(score, 0.1, cached_tokens=1200)
    assert (s.uncached_tokens, s.fetched_tokens) == (800, 200)
    # more than that reused: the rest was in HBM unknown to the index
    s = sample_of(score, 0.1, cached_tokens=1500)
    assert (s.uncached_tokens, s.fetched_tokens) == (500, 200)


def test_the_remote_tiers_fixed_cost_is_taken_out_of_a_fetching_requests_observation() -> None:
    r = replicas()[0]
    fetching = score_on(r, Overlap(40_000, remote_tokens=30_000))
    assert fetching.estimate.remote_fetch
    assert sample_of(fetching, 0.1, None, remote_fixed_s=0.026).observed_s == pytest.approx(0.074)
    cold = score_on(r, Overlap(4000))
    assert sample_of(cold, 0.1, None, remote_fixed_s=0.026).observed_s == 0.1


def test_a_load_waited_past_anyway_is_learned_as_the_queue_it_overlapped() -> None:
    """A fetch that ends before the prefill is free for the request: its TTFT is the queue's, so
    its sample carries the steps the prefill ran during the fetch, not the fetch, and predicts
    at the terms in use what the estimate said."""
    r = replicas()[0]
    overlap = Overlap(3000, remote_tokens=2000)
    queued = score_on(r, overlap, Load(pending_prefill_tokens=40_000))
    e = queued.estimate
    assert e.remote_fetch and e.queue_s > 0
    step_tokens = r.costs.engine.max_num_batched_tokens
    s = sample_of(queued, e.ttft_s, None, r.costs.remote_fixed_s, step_tokens)
    assert (s.swapped_tokens, s.fetched_tokens) == (0, 0)
    assert s.queued_tokens > e.queue_tokens and s.steps > e.steps
    assert s.observed_s == e.ttft_s  # the tier's fixed cost was waited past too
    assert OnlineFit(SEED).predict_s(s) == pytest.approx(e.ttft_s)
    # with nothing ahead the fetch is the request's own wait: learned as a fetch
    alone = score_on(r, overlap)
    s = sample_of(alone, alone.estimate.ttft_s, None, r.costs.remote_fixed_s, step_tokens)
    assert s.fetched_tokens == 2000 and s.queued_tokens == alone.estimate.queue_tokens


def test_fetches_behind_a_queue_do_not_teach_the_fetch_rate() -> None:
    """A fleet 10x slower than the defaults whose fetches all wait behind a queue that outlasts
    them: their TTFTs say nothing of the fetch rate, which stays at its seed. Taken as load plus
    queue they moved it: here to ~5x its seed, on a slow tiered fleet to its lower bound."""
    rs = replicas()
    learner = CostLearner("fit", rs, Metrics())
    rng = random.Random(7)
    true = SEED.scaled(10.0)
    for i in range(160):
        r = rs[i % 2]
        fetch = i % 4 == 0
        overlap = Overlap(rng.randrange(2000, 4000), remote_tokens=1500 if fetch else 0)
        load = Load(pending_prefill_tokens=rng.randrange(3000, 6000) if fetch else 0)
        observed_s = estimate(overlap, load, r.costs, true).ttft_s
        score = Score(r.name, overlap, estimate(overlap, load, r.costs, r.terms))
        candidate = Candidate(r.name, load=load)
        learner.observe(Observation(r, score, observed_s, None, candidate, None))
    terms = learner.terms_of(rs[0].name)
    assert terms.prefill_s_per_token == pytest.approx(true.prefill_s_per_token, rel=0.1)
    assert terms.fetch_s_per_token == pytest.approx(SEED.fetch_s_per_token, rel=0.5)


@pytest.mark.parametrize("mode", ["fit", "correction", "none"])
def test_a_slow_fleet_is_learned_as_the_mode_says(mode: Mode) -> None:
    """A fleet 10x slower than the defaults: `fit` learns it, `correction` hits its 4x bound,
    `none` keeps the defaults."""
    rs = replicas()
    learner = CostLearner(mode, rs, Metrics())
    rng = random.Random(1)
    for i in range(60):
        overlap = Overlap(rng.randrange(200, 4000))
        observe(learner, rs[i % 2], overlap, slow_ttft(overlap, 10.0))
    per_token = learner.terms_of(rs[0].name).prefill_s_per_token / SEED.prefill_s_per_token
    expected = {"fit": 10.0, "correction": CORRECTION_BOUNDS[1], "none": 1.0}[mode]
    assert per_token == pytest.approx(expected, rel=0.1)


def test_a_new_replica_uses_its_pools_fit_until_it_has_its_own() -> None:
    rs = replicas()
    learner = CostLearner("fit", rs, Metrics())
    rng = random.Random(2)
    for _ in range(MIN_OWN_SAMPLES + 20):  # only the first replica serves
        overlap = Overlap(rng.randrange(200, 4000))
        observe(learner, rs[0], overlap, slow_ttft(overlap, 5.0))
    described = learner.describe()["replicas"]
    assert described[rs[0].name]["source"] == "own fit"  # no tier to hold at the pool's
    assert described[rs[1].name]["source"] == "pool 'p' fit"
    assert described[rs[1].name]["samples"] == 0
    other = learner.terms_of(rs[1].name).prefill_s_per_token / SEED.prefill_s_per_token
    assert other == pytest.approx(5.0, rel=0.1)
    assert rs[1].terms is not None and rs[1].terms.prefill_s_per_token == pytest.approx(
        learner.terms_of(rs[1].name).prefill_s_per_token
    )


def test_a_replica_holds_a_term_it_has_rarely_excited_at_its_pools_value() -> None:
    """A remote fetch is a minority of each replica's requests: until a replica has fetched
    MIN_EXCITED times, its fit holds the fetch rate at the pool's, which every replica's
    fetches teach."""
    rs = replicas()
    learner = CostLearner("fit", rs, Metrics())
    rng = random.Random(4)
    slowdown = 10.0

    def serve(replica: Replica, fetch: bool) -> None:
        remote = rng.randrange(1000, 4000) if fetch else 0
        overlap = Overlap(remote + rng.randrange(200, 2000), remote_tokens=remote)
        fetch_s = remote * SEED.fetch_s_per_token * slowdown + replica.costs.remote_fixed_s
        observed_s = slow_ttft(overlap, slowdown) + (fetch_s if remote else 0.0)
        observe(learner, replica, overlap, observed_s)

    for i in range(120):  # each replica fetches on every 4th of its requests: 15 of 60
        serve(rs[i % 2], fetch=i % 8 < 2)
    for r in rs:
        described = learner.describe()["replicas"][r.name]
        assert described["source"] == "own fit, fetch_s_per_token at pool 'p''s"
        fetch_s = 1 / described["fetch_tokens_per_s"]
        assert fetch_s == pytest.approx(SEED.fetch_s_per_token * slowdown, rel=0.2)
    for _ in range(MIN_EXCITED - 15):
        serve(rs[0], fetch=True)
    described = learner.describe()["replicas"][rs[0].name]
    assert described["source"] == "own fit"
    own_fetch = learner.terms_of(rs[0].name).fetch_s_per_token
    assert own_fetch == pytest.approx(SEED.fetch_s_per_token * slowdown, rel=0.2)


def test_a_replica_that_joins_later_starts_from_the_pools_latest_fit() -> None:
    """Once both replicas have their own fits the pool's is solved only every few observations
    (gateway/accounting/calibration.py POOL_REFIT_EVERY); a replica joining after the fleet slowed
    down starts from a pool fit that followed the slowdown."""
    rs = replicas()
    learner = CostLearner("fit", rs, Metrics())
    rng = random.Random(3)
    for i in range(2 * MIN_OWN_SAMPLES):
        overlap = Overlap(rng.randrange(200, 4000))
        observe(learner, rs[i % 2], overlap, slow_ttft(overlap, 3.0))
    for i in range(30):  # the fleet slows down: only the pool's window knows it before a refit
        overlap = Overlap(rng.randrange(200, 4000))
        observe(learner, rs[i % 2], overlap, slow_ttft(overlap, 8.0))
    config = parse_config({"pools": [{"name": "p", "replicas": [*URLS, "http://127.0.0.1:3"]}]})
    newcomer = Registry(config).replicas["127.0.0.1:3"]
    learner.add(newcomer)
    assert learner.describe()["replicas"][newcomer.name]["source"] == "pool 'p' fit"
    pooled = learner.terms_of(newcomer.name).prefill_s_per_token / SEED.prefill_s_per_token
    assert pooled > 5.0  # it followed the slowdown


def test_unusable_observations_teach_nothing() -> None:
    rs = replicas()
    learner = CostLearner("fit", rs, Metrics())
    observe(learner, rs[0], Overlap(1000), 0.0)  # no first byte
    observe(learner, rs[0], Overlap(1000), 3600.0)  # an hour: a hung stream, not a TTFT
    assert learner.describe()["replicas"][rs[0].name]["samples"] == 0
    assert learner.terms_of(rs[0].name) == SEED


def test_a_second_gateway_resumes_the_fits_of_the_first() -> None:
    first_replicas, second_replicas = replicas(), replicas()
    first = CostLearner("fit", first_replicas, Metrics())
    rng = random.Random(3)
    for i in range(50):
        overlap = Overlap(rng.randrange(200, 4000))
        observe(first, first_replicas[i % 2], overlap, slow_ttft(overlap, 3.0))
    second = CostLearner("fit", second_replicas, Metrics())
    assert second.resume(first.states()) == 3  # two replicas and the pool
    name = first_replicas[0].name
    assert second.terms_of(name) == first.terms_of(name)
    assert second.resume(first.states()) == 0  # nothing newer to adopt


def test_metrics_show_the_fitted_terms_and_the_error() -> None:
    rs = replicas()
    metrics = Metrics()
    learner = CostLearner("fit", rs, metrics)
    overlap = Overlap(2000)
    observe(learner, rs[0], overlap, slow_ttft(overlap, 10.0))
    value = metrics.registry.get_sample_value
    labels = {"replica": rs[0].name}
    assert value("cachelane_ttft_estimate_error_ratio_count", labels) == 1
    # a 10x miss after a 3x prior: the typical miss grew, decisions lean on the robust cost
    assert (value("cachelane_estimate_miss_ratio", labels) or 0.0) > 2.0
    assert value("cachelane_estimate_robust_share_ratio", labels) == 1.0
    costs = learner.describe()["replicas"][rs[0].name]
    assert costs["estimate_misses_seen"] == 1 and costs["robust_share"] == 1.0
    fitted = value(
        "cachelane_cost_fit_seconds_per_token", {"replica": rs[0].name, "term": "prefill"}
    )
    assert fitted is not None and fitted > 0


async def test_queued_observations_are_learned_in_one_batch_off_the_request() -> None:
    """A request's observation is queued: the terms move only when the batch is learned (its
    timer, or a read through the learner), and end where one-by-one learning ends."""
    rs, one_by_one_rs = replicas(), replicas()
    batched = CostLearner("fit", rs, Metrics())
    one_by_one = CostLearner("fit", one_by_one_rs, Metrics())
    overlap = Overlap(2000)
    for i in range(MIN_OWN_SAMPLES + 5):
        observed_s = slow_ttft(overlap, 3.0) * (1 + 0.01 * (i % 3))
        batched.queue(Observation(rs[0], score_on(rs[0], overlap), observed_s, None))
        observe(one_by_one, one_by_one_rs[0], overlap, observed_s)
    assert rs[0].terms == SEED  # nothing learned yet: the request did not wait for it
    assert batched.describe()["replicas"][rs[0].name]["samples"] == MIN_OWN_SAMPLES + 5
    assert rs[0].terms is not None and one_by_one_rs[0].terms is not None
    assert rs[0].terms.prefill_s_per_token == pytest.approx(
        one_by_one_rs[0].terms.prefill_s_per_token, rel=0.05
    )


def test_without_an_event_loop_a_queued_observation_is_learned_at_once() -> None:
    r = replicas()[0]
    learner = CostLearner("fit", [r], Metrics())
    learner.queue(Observation(r, score_on(r, Overlap(2000)), 0.5, None))
    assert learner._own[r.name].samples == 1


def test_an_observation_is_learned_at_the_terms_in_use_when_it_is_learned() -> None:
    """A request decided at the seed's rates, learned after the fit found the fleet 5x slower:
    its features (the queue it waited for) are re-derived from the decision's snapshot at the
    fitted terms, as if the decision had been made with them."""
    twins = [CostLearner("fit", replicas(), Metrics()) for _ in range(2)]
    for learner in twins:
        rng = random.Random(6)
        r = next(iter(learner._replicas.values()))
        for _ in range(40):
            overlap = Overlap(rng.randrange(200, 4000))
            observe(learner, r, overlap, slow_ttft(overlap, 5.0))
    with_snapshot, rescored_already = twins
    r = next(iter(with_snapshot._replicas.values()))
    candidate = Candidate(r.name, load=Load(pending_prefill_tokens=20_000, busy_s=0.2))
    overlap = Overlap(1500)
    score = Score(r.name, overlap, estimate(overlap, candidate.load, r.costs))  # at the seed
    with_snapshot.observe(Observation(r, score, 3.0, None, candidate, None))
    r2 = next(iter(rescored_already._replicas.values()))
    fitted = rescored_already.terms_of(r2.name)
    again = rescored(score, candidate, fitted, None)
    assert again.estimate.queue_tokens > score.estimate.queue_tokens
    rescored_already.observe(Observation(r2, again, 3.0, None))
    assert with_snapshot.terms_of(r.name) == rescored_already.terms_of(r2.name)


def test_a_fleet_the_fit_learns_earns_its_estimates_authority() -> None:
    """A fleet 10x slower than the defaults: its estimates miss widely at first, so a decision
    leans on the robust rule there (a wide band); as the fit learns it, the band narrows."""
    rs = replicas()
    learner = CostLearner("fit", rs, Metrics())
    rng = random.Random(1)
    assert rs[0].candidate(0.0, 5.0).estimate_band == pytest.approx(2.0)  # the prior: 3x
    bands: dict[int, float] = {}
    for i in range(160):
        overlap = Overlap(rng.randrange(200, 4000))
        observe(learner, rs[i % 2], overlap, slow_ttft(overlap, 10.0))
        bands[i // 2 + 1] = rs[0].candidate(0.0, 5.0).estimate_band or 0.0
    assert rs[0].estimate_error.samples == 80
    assert bands[3] > 1.0  # the first answers missed by up to 10x
    assert bands[80] < 0.1 < bands[20] < bands[3]  # then the fit learnt the fleet
