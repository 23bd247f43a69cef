"""`python -m loadtest.bench.tiers` end to end, with tiny arms: real sim fleets, real gateways.

Checks only that it runs and that the JSON has its shape; the numbers are the benchmark's job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.bench_cli import run_ok

pytestmark = pytest.mark.slow  # `make check` leaves it out: a benchmark smoke

BENCH_TIMEOUT_S = 90  # ~25 s here: 4 arms of 2 s plus two fleets' and four gateways' start-up


@pytest.mark.timeout(BENCH_TIMEOUT_S + 10)
def test_bench_tiers_runs_and_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "bench_tiers.json"
    args = [
        "--pinning-duration-s", "2", "--reuse-duration-s", "2",
        "--shapes", "high", "--modes", "always,reuse", "--seed", "3",
    ]  # fmt: skip
    run_ok(["-m", "loadtest.bench.tiers", *args, "--out", str(out)], BENCH_TIMEOUT_S)

    data = json.loads(out.read_text())
    pinning = data["pinning"]
    assert set(pinning["arms"]) == {"unpinned", "pinned"}
    for name, arm in pinning["arms"].items():
        for group in ("critical", "standard"):
            summary = arm["groups"][group]
            assert summary["requests"] == pinning["requests"][group], (name, group)
            assert summary["errors"] == 0, (name, group)
            assert set(summary) >= {"ttft_p50_ms", "ttft_p99_ms", "throughput_req_per_s"}
        assert arm["critical_off_pinned_pool"] >= 0
        assert all(v >= 0 for v in arm["gateway"].values())
    pinned = pinning["arms"]["pinned"]
    spilled = pinned["gateway"].get("cachelane_critical_fallbacks{action=spill}", 0)
    assert pinned["critical_off_pinned_pool"] <= spilled, "off the pinned pool only by fallback"
    assert set(pinning["ratios_pinned_over_unpinned"]) >= {"critical_ttft_p99"}

    admission = data["remote_admission"]
    assert list(admission["results"]) == ["high"]
    modes = admission["results"]["high"]
    assert list(modes) == ["always", "reuse"]
    requests = admission["workloads"]["high"]["requests"]
    for mode, arm in modes.items():
        summary = arm["groups"]["all"]
        assert summary["requests"] == requests and summary["errors"] == 0, mode
        assert 0 <= summary["hit_rate"] <= 1, mode
        assert arm["sims"]["cachelane_sim_remote_bytes_written"] >= 0, mode
        decisions = sum(
            arm["gateway"].get(f"cachelane_remote_admission{{verdict={v}}}", 0)
            for v in ("admitted", "refused")
        )
        assert decisions == requests, mode
    assert modes["always"]["gateway"].get("cachelane_remote_admission{verdict=refused}", 0) == 0
    assert data["wall_time_s"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
