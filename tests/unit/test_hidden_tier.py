"""routing/hidden_tier.py and where it acts: a KV tier nobody told the gateway of, found from what
the engines report they reused, read by the pool's replicas as ANY_HOLDER."""

from __future__ import annotations

import logging

import pytest

from gateway.accounting.calibration import CostLearner, Observation
from gateway.config import parse_config
from gateway.fleet.registry import Registry
from gateway.telemetry.metrics import Metrics
from routing.cost import Load, Overlap, estimate
from routing.decide import Candidate, Policy, RouteRequest, Score, overlap_of, runs_of
from routing.hidden_tier import ANY_HOLDER, MIN_OPPORTUNITIES, HiddenTier
from routing.pipeline import PipelineSettings
from routing.pipeline_writes import admit
from routing.types import Location, Tier

BS = 16


def test_inferred_once_the_engines_reuse_what_others_held_and_given_up_when_they_stop() -> None:
    h = HiddenTier()
    flips = [h.observe(640, 640) for _ in range(MIN_OPPORTUNITIES + 4)]
    assert h.inferred and flips.count(True) == 1
    for _ in range(30):
        h.observe(640, 0)
    assert not h.inferred and h.tier is None


def test_a_gap_shorter_than_two_blocks_is_no_evidence() -> None:
    h = HiddenTier()
    for _ in range(50):
        h.observe(16, 16)
    assert h.opportunities == 0 and not h.inferred


def test_a_few_surpluses_are_not_enough() -> None:
    h = HiddenTier()
    for _ in range(MIN_OPPORTUNITIES - 1):
        h.observe(640, 640)
    assert not h.inferred


def test_any_holder_extends_the_overlap_over_every_block_someone_holds() -> None:
    a, b = Location("a", Tier.HBM), Location("b", Tier.HBM)
    runs = runs_of([frozenset({a, b})] * 2 + [frozenset({b})] * 3)
    request = RouteRequest((), 100, BS)
    told = overlap_of(Candidate("a"), runs, request)
    hidden = overlap_of(Candidate("a", remote_tier=ANY_HOLDER), runs, request)
    assert (told.hbm_tokens, told.remote_tokens) == (32, 0)
    assert (hidden.hbm_tokens, hidden.remote_tokens) == (32, 48)


def test_the_gateway_never_tells_engines_what_to_write_to_a_hidden_tier() -> None:
    settings = PipelineSettings(policy=Policy.CACHE_AWARE, block_size_tokens=BS)
    assert admit(Candidate("a", remote_tier=ANY_HOLDER), 5, [], 200, settings) is None


def test_answers_that_reuse_what_other_replicas_held_make_the_pool_read_a_hidden_tier(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = parse_config(
        {"pools": [{"name": "p", "replicas": ["http://127.0.0.1:1", "http://127.0.0.1:2"]}]}
    )
    rs = list(Registry(config).replicas.values())
    learner = CostLearner("fit", rs, Metrics())
    assert rs[0].candidate(0.0, 5.0).remote_tier is None
    overlap = Overlap(2_000, hbm_tokens=160)
    score = Score(rs[0].name, overlap, estimate(overlap, Load(), rs[0].costs, None))
    with caplog.at_level(logging.INFO, logger="cachelane.calibration"):
        for _ in range(MIN_OPPORTUNITIES + 2):  # the other replica held 1,600 tokens; reused
            learner.observe(Observation(rs[0], score, 0.05, 1_600, fleet_cached_tokens=1_600))
    assert rs[0].hidden_tier is rs[1].hidden_tier  # the pool's evidence
    assert rs[1].candidate(0.0, 5.0).remote_tier == ANY_HOLDER
    assert "shared a KV tier the config does not name" in caplog.text


def test_a_configured_remote_tier_is_never_second_guessed() -> None:
    config = parse_config(
        {
            "remote_tiers": [{"name": "kv"}],
            "pools": [{"name": "p", "replicas": ["http://127.0.0.1:1"], "remote_tier": "kv"}],
        }
    )
    (r,) = Registry(config).replicas.values()
    learner = CostLearner("fit", [r], Metrics())
    overlap = Overlap(2_000, hbm_tokens=160)
    score = Score(r.name, overlap, estimate(overlap, Load(), r.costs, None))
    for _ in range(20):
        learner.observe(Observation(r, score, 0.05, 1_600, fleet_cached_tokens=1_600))
    assert r.hidden_tier.opportunities == 0
    assert r.candidate(0.0, 5.0).remote_tier == "kv"
