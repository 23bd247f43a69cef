"""`python -m loadtest.bench.overhead_floor --quick` end to end with the bare proxy, the routing
floor and cachelane, one worker and two (the Rust routers are left out: they install from
PyPI). Checks that it runs and what it writes; the numbers are docs/bench/overhead.md's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.bench_cli import run_ok

pytestmark = pytest.mark.slow  # `make check` leaves it out: a benchmark smoke

BENCH_TIMEOUT_S = 90  # ~25 s here: a fleet and three proxies start, 20 requests and 4 turns each


@pytest.mark.timeout(BENCH_TIMEOUT_S + 10)
def test_bench_overhead_floor_runs_with_the_bare_proxy(tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    args = ["--quick", "--arms", "bare,cachelane", "--workers", "2", "--out", str(out)]
    run_ok(["-m", "loadtest.bench.overhead_floor", *args], BENCH_TIMEOUT_S)
    result = json.loads(out.read_text())
    low = {r["router"]: r for r in result["low_load"]}
    cachelane = {"cachelane:cache_aware", "cachelane:cache_aware+2w"}
    assert set(low) == {"bare:round_robin", "bare:cache_aware", *cachelane}
    assert all(r["n"] == 20 for r in low.values())
    sat = result["saturation"]
    assert {(r["prompt_tokens"], r["stream"]) for r in sat} == {
        (256, True),
        (256, False),
        (8192, True),
        (8192, False),
    }
    assert all(r["errors"] == 0 and r["ok"] > 0 and r["client_cpu_s"] > 0 for r in sat)
    floor = [r for r in sat if r["router"] == "bare:round_robin"]
    assert all(r["requests_per_cpu_s"] and r["per_cpu_s_vs_floor"] == 1.0 for r in floor)
    goals = {g["router"]: g for g in result["goals"]}
    assert set(goals) == {"bare:cache_aware", *cachelane}  # vllm-router did not: its ratios None
    assert all(
        g["per_cpu_s_vs_floor_share"] and g["per_cpu_s_vs_vllm"] is None for g in goals.values()
    )
    assert set(result["load_average"]) == {"start", "after_low_load", "end"}
    assert out.with_suffix(".png").stat().st_size > 0
