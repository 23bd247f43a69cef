"""The oracle floor: a replica's requests replayed with and without those sent after each."""

import pytest

from loadtest.bench.estimate_oracle import (
    SimTimes,
    best_scaled_p90,
    oracle_errors,
    replay_errors,
    replay_replicas,
)
from loadtest.sim.steps import StepSettings

SETTINGS = StepSettings(
    prefill_tokens_per_s=1_000, max_num_batched_tokens=2_048, step_overhead_s=0.0
)


def times(
    index: int, replica: str, at_ms: float, loaded_ms: float, first_ms: float, tokens: int
) -> SimTimes:
    return SimTimes(index, replica, at_ms, loaded_ms, first_ms, tokens)


def test_a_request_overtaken_while_its_kv_loads_is_alone_what_it_would_have_been() -> None:
    # 0 loads its KV for 50 ms; 1 arrives 10 ms after it, ready, and takes a 1 s step first
    # (vLLM skips a loading request): 0 computes its 100 tokens only after that step.
    replayed = replay_replicas(
        [times(0, "a", 5_000.0, 50.0, 1_110.0, 100), times(1, "a", 5_010.0, 0.0, 1_000.0, 1_000)],
        SETTINGS,
    )
    assert replayed[0].replay_ms == pytest.approx(1_110.0)
    assert replayed[0].alone_ms == pytest.approx(150.0)  # 50 ms load + 100 ms step
    assert replayed[1].replay_ms == replayed[1].alone_ms == pytest.approx(1_000.0)
    observed = {0: 1_115.0, 1: 1_005.0}  # 5 ms outside the sim
    errors = oracle_errors(replayed, observed)
    assert errors[0] == pytest.approx(960 / 1_115)
    assert errors[1] == pytest.approx(0.0)
    assert replay_errors(replayed, observed) == pytest.approx([0.0, 0.0])


def test_replicas_are_replayed_apart_and_arrivals_in_any_order() -> None:
    replayed = replay_replicas(
        [times(1, "b", 2_000.0, 0.0, 500.0, 500), times(0, "a", 1_000.0, 0.0, 300.0, 300)],
        SETTINGS,
    )
    assert replayed[0].alone_ms == pytest.approx(300.0)
    assert replayed[1].alone_ms == pytest.approx(500.0)


def test_the_best_scale_is_the_factor_that_in_hindsight_fits_the_observed_times() -> None:
    # each replica took twice what its request alone needs: the factor 2.00 explains both
    replayed = replay_replicas(
        [times(0, "a", 0.0, 0.0, 200.0, 100), times(1, "b", 0.0, 0.0, 600.0, 300)], SETTINGS
    )
    observed = {0: 200.0, 1: 600.0}
    assert oracle_errors(replayed, observed) == pytest.approx([0.5, 0.5])
    scale, p90 = best_scaled_p90(replayed, observed)
    assert scale == pytest.approx(2.0)
    assert p90 == pytest.approx(0.0)


def test_a_report_without_the_step_engines_times_is_left_out() -> None:
    assert SimTimes.from_usage(0, "a", {"computed_tokens": 10.0}) is None
    usage = {"arrived_at_ms": 1.0, "loaded_ms": 2.0, "first_token_ms": 3.0, "computed_tokens": 4.0}
    assert SimTimes.from_usage(7, "a", usage) == SimTimes(7, "a", 1.0, 2.0, 3.0, 4)
