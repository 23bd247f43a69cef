"""`python -m loadtest.bench.estimate --quick` end to end: a real sim fleet, real gateways.

Checks only that it runs and that the JSON has its shape; the numbers are the benchmark's job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.bench.estimate import FIRST_N, TRUE_ARM, main

pytestmark = pytest.mark.slow  # `make check` leaves it out: a benchmark smoke

BENCH_TIMEOUT_S = 120  # ~25 s here: one fleet, three gateways, 4 s arms

ARM_FIELDS = {
    "requests", "ok", "errors", "err_p50_first", "err_p90_first", "err_p50_after",
    "err_p90_after", "est_over_obs_p50", "hit_rate", "ttft_p50_ms", "ttft_p99_ms",
    "prefill_utilisation", "tier_share", "sims", "per_request", "err_p90_after_goal",
    "n_after_goal", "after_load_est_ms_mean", "after_load_obs_ms_mean",
    "after_load_err_p90_after", "err_p90_after_goal_no_future",
    "err_p90_after_goal_no_future_best_scale", "no_future_best_scale",
    "replay_err_p90_after_goal", "n_replayed_goal",
}  # fmt: skip


@pytest.mark.timeout(BENCH_TIMEOUT_S)
def test_bench_estimate_runs_and_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "bench_estimate.json"
    code = main(["--quick", "--speeds", "3", "--modes", "none,fit", "--out", str(out)])
    assert code == 0

    data = json.loads(out.read_text())
    assert data["first_n"] == FIRST_N
    assert data["arms"] == [TRUE_ARM, "none", "fit"]
    assert data["wall_time_s"] > 0
    [speed] = data["results"]
    assert speed["speed"] == 3
    assert speed["sim_costs"]["prefill_tokens_per_s"] == pytest.approx(10_000)
    assert list(speed["arms"]) == [TRUE_ARM, "none", "fit"]
    for name, arm in speed["arms"].items():
        assert set(arm) >= ARM_FIELDS, name
        assert arm["requests"] == data["requests"] > 0, name
        assert arm["errors"] == 0, (name, arm["errors_seen"])
        assert arm["err_p50_first"] is not None and arm["err_p50_first"] >= 0, name
        assert 0 <= arm["hit_rate"] <= 1, name
        assert arm["sims"]["cachelane_sim_steps"] > 0, name  # the step engine, by default
        assert set(arm["tier_share"]) == {"hbm", "cpu", "remote", "computed"}, name
        series = arm["per_request"]
        assert len(series["est_ms"]) == len(series["obs_ms"]) == arm["requests"], name
        assert all(v is not None and v > 0 for v in series["obs_ms"]), name
        # the sims say when each request arrived: the floor replays each replica's requests
        assert all("arrived_at_ms" in sim for sim in series["sim"]), name
    assert out.with_suffix(".png").stat().st_size > 0
