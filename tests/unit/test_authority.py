"""routing/authority.py and cache_aware's use of it: the estimate decides as far as it has been
right; within its doubt, prefix hits with the load kept in balance."""

from __future__ import annotations

import math
import random

import pytest

from routing.authority import (
    DOUBTED_BAND,
    PRIOR_LOG_ERROR,
    TRUSTED_BAND,
    EstimateError,
    doubt_of,
)
from routing.cost import Estimate, Load, Overlap
from routing.policies.base import Candidate, Choice, RouteRequest, Score
from routing.policies.cache_aware import CacheAware

BS = 16


def score(name: str, ttft_s: float, cached_tokens: int) -> Score:
    estimate = Estimate(
        fixed_s=0.0, queue_s=0.0, swap_s=0.0, remote_s=0.0, prefill_s=ttft_s, remote_fetch=False
    )
    return Score(name, Overlap(2_000, hbm_tokens=cached_tokens), estimate)


def first(*rows: tuple[str, float, int, int, float | None]) -> str:
    """The chosen replica among rows of (name, estimated TTFT, cached tokens of its 2,000,
    prefill tokens already sent there, band)."""
    candidates = [
        Candidate(n, load=Load(in_flight=p // 1000, pending_prefill_tokens=p), estimate_band=b)
        for n, _, _, p, b in rows
    ]
    scores = tuple(score(n, t, c) for n, t, c, _, _ in rows)
    choice = Choice(RouteRequest((), 2_000, BS), candidates, scores, 0, random.Random(1))
    return CacheAware().rank(choice)[0][0]


def test_a_replica_nobody_measured_starts_at_the_prior_and_earns_its_way_down() -> None:
    e = EstimateError()
    assert e.band() == pytest.approx(2.0)  # a 3x miss either way
    for _ in range(40):
        e.observe(0.100, 0.110)  # right within 10%
    assert e.samples == 40
    assert e.band() < 0.2
    assert e.log_error > math.log(1.1) * 0.9  # what it misses by, not less


def test_fast_answers_and_empty_estimates_are_not_counted() -> None:
    e = EstimateError()
    e.observe(0.5, 0.010)  # 10 ms: the network's share is too large
    e.observe(0.0, 0.200)
    assert (e.samples, e.log_error) == (0, PRIOR_LOG_ERROR)


def test_one_stalled_answer_moves_the_error_a_bounded_step() -> None:
    e = EstimateError(log_error=0.1, samples=50)
    e.observe(0.1, 10_000.0)
    assert e.log_error < 0.1 + 0.08 * math.log(20.0) + 1e-9


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        # a model that has been right: its cheaper estimate wins, though the other holds more
        ([("a", 0.100, 1_600, 0, 0.1), ("b", 0.080, 0, 0, 0.1)], "b"),
        # the same estimates from a model in doubt: the robust cost, and the prefix, win
        ([("a", 0.100, 1_600, 0, 2.0), ("b", 0.080, 0, 0, 2.0)], "a"),
        # in doubt, a holder with 6,000 tokens of prefill already sent there loses
        ([("a", 0.100, 1_600, 6_000, 2.0), ("b", 0.080, 0, 0, 2.0)], "b"),
        # half in doubt: a large enough gap in the estimate still decides
        ([("a", 0.400, 1_600, 0, 0.6), ("b", 0.080, 0, 0, 0.6)], "b"),
        # no band given (the what-if replay): the model's cost alone
        ([("a", 0.100, 1_600, 0, None), ("b", 0.080, 0, 0, None)], "b"),
    ],
    ids=["right", "doubt-prefix", "doubt-load", "half-doubt", "replay"],
)
def test_cache_aware_leans_on_the_estimate_as_far_as_it_has_been_right(
    rows: list[tuple[str, float, int, int, float | None]], expected: str
) -> None:
    assert first(*rows) == expected


@pytest.mark.parametrize(
    ("band", "doubt"), [(0.0, 0.0), (TRUSTED_BAND, 0.0), (DOUBTED_BAND, 1.0), (5.0, 1.0)]
)
def test_doubt_runs_from_a_trusted_to_a_doubted_band(band: float, doubt: float) -> None:
    assert doubt_of(band) == doubt
    assert 0 < doubt_of((TRUSTED_BAND + DOUBTED_BAND) / 2) < 1
