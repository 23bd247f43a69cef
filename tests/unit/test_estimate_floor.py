"""The estimate benchmark's error floor: a bound no model with a fixed term beats on a run."""

from __future__ import annotations

import math
import random

import pytest

from loadtest.bench.estimate import Sample, error_floor, outside_engine, with_sim_phases
from routing.whatif.summary import percentile


def test_no_constant_for_the_fixed_requests_beats_the_floor() -> None:
    rng = random.Random(3)
    fixed_obs = [rng.uniform(0.013, 0.034) for _ in range(120)]  # 13-34 ms of jitter
    others = 80  # requests a model gets exactly right
    share = len(fixed_obs) / (len(fixed_obs) + others)
    floor = error_floor(fixed_obs, share)
    assert 0.2 < floor < 1.0
    for c in [x / 1000 for x in range(5, 60)]:
        errors = [abs(c - o) / o for o in fixed_obs] + [0.0] * others
        assert percentile(errors, 90) >= floor - 1e-9


def test_no_floor_when_the_fixed_requests_are_a_tenth_or_less() -> None:
    assert math.isnan(error_floor([0.02, 0.03], 0.1))
    assert math.isnan(error_floor([], 0.5))


def test_outside_engine_takes_the_observed_time_outside_the_sims_engine_for_its_terms() -> None:
    """TTFT 100 ms of which the sim's engine took 60: 40 ms outside it. The estimate (70 ms: 10
    of them gateway, fixed and relay terms, 60 of engine terms) is 30% off, and 0% with the
    observed 40 ms in place of its own 10."""
    s = Sample(0, 0.0, status=200, obs_s=0.1, est_s=0.07)
    s.est_terms_ms = {"gateway": 2.0, "fixed": 7.0, "relay": 1.0, "prefill": 60.0}
    s.sim = {"first_token_ms": 60.0}
    outside, errors = outside_engine([s, Sample(1, 0.0, status=200, obs_s=0.1, est_s=0.1)])
    assert outside == [pytest.approx(40.0)]
    assert errors == [pytest.approx(0.0)]
    assert s.rel_error == pytest.approx(0.3)


def test_the_sims_phases_take_the_place_of_the_estimates_terms_for_them() -> None:
    """TTFT 100 ms: the sim loaded the KV for 30 ms (the estimate said 10) and took 60 from the
    load to the first token (the estimate's queue and prefill: 40). The estimate (60 ms) is 40%
    off; with the sim's load 20% off, with its wait 20% off, with both exact. A request the sim
    did not report on is left out."""
    s = Sample(0, 0.0, status=200, obs_s=0.1, est_s=0.06)
    s.est_terms_ms = {"fixed": 10.0, "load": 10.0, "queue": 15.0, "prefill": 25.0}
    s.sim = {"located_ms": 2.0, "loaded_ms": 32.0, "first_token_ms": 92.0}
    bare = Sample(1, 0.0, status=200, obs_s=0.1, est_s=0.1)
    assert s.rel_error == pytest.approx(0.4)
    assert with_sim_phases([s, bare], ["load"]) == [pytest.approx(0.2)]
    assert with_sim_phases([s, bare], ["wait"]) == [pytest.approx(0.2)]
    assert with_sim_phases([s, bare], ["load", "wait"]) == [pytest.approx(0.0)]
