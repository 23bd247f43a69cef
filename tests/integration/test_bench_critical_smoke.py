"""`python -m loadtest.bench.critical --quick` end to end with three arms: a real sim fleet, real
gateways. Checks only that it runs and that the JSON has its shape; the numbers are the
benchmark's job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.bench.critical import main

pytestmark = pytest.mark.slow  # `make check` leaves it out: a benchmark smoke


@pytest.mark.timeout(180)  # ~40 s here: one fleet, three gateways, arms of 5 s plus draining
def test_bench_critical_quick_runs_and_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    arms = ["no-tenants", "flow-control", "priority"]
    assert main(["--quick", "--arms", ",".join(arms), "--out", str(out)]) == 0

    data = json.loads(out.read_text())
    assert list(data["arms"]) == arms
    assert data["not_run"] == {}
    requests = data["settings"]["measured_requests"]
    assert 0 < requests < data["settings"]["requests"]  # the warm-up is replayed, not counted
    assert data["settings"]["load"]["utilisation_round_robin"] > 0
    for name, arm in data["arms"].items():
        groups = arm["groups"]
        assert set(groups) >= {"critical", "standard", "all", "voice", "agent", "chat", "bulk"}
        assert groups["all"]["requests"] == requests, name
        assert groups["critical"]["requests"] + groups["standard"]["requests"] == requests
        for group in ("critical", "standard", "all"):
            g = groups[group]
            assert set(g) >= {"ttft_p50_ms", "ttft_p99_ms", "hit_rate", "shed", "failed"}, name
            assert g["shed_with_retry_after"] <= g["shed"], name
            assert g["ok"] + g["shed"] + g["failed"] == g["requests"], (name, group)
            assert 0 <= g["hit_rate"] <= 1, (name, group)
        assert set(arm["pools"]) == {"hbm-only", "offload"}, name
        assert arm["config"] is not None, name
    flow = data["arms"]["flow-control"]
    assert flow["config"]["flow_control"] == {"enabled": True}
    assert all(p["engine_priority"] for p in flow["config"]["pools"])
    assert data["arms"]["no-tenants"]["config"]["flow_control"] == {"enabled": False}
    priority = data["arms"]["priority"]["config"]
    assert all(p["engine_priority"] and not p.get("pinned") for p in priority["pools"])
    assert "flow_control" not in priority  # the default: on
    assert flow["critical_placement"]["hbm-only"]["requests"] >= 0
    assert data["wall_time_s"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
