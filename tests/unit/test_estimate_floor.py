"""The estimate benchmark's error floor: a bound no model with a fixed term beats on a run."""

from __future__ import annotations

import math
import random

from loadtest.bench.estimate import error_floor
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
