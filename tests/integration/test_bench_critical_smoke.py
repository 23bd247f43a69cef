"""`python -m loadtest.bench.critical --quick` end to end with the three cachelane arms: real sim
fleets (one started for each arm), real gateways. Checks only that it runs and that the JSON has
its shape; the numbers are the benchmark's job."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from gateway.config import parse_config
from loadtest.bench import critical
from loadtest.bench.critical import main

pytestmark = pytest.mark.slow  # `make check` leaves it out: a benchmark smoke

CLASS_FIELDS = {
    "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "excess_p50_ms", "excess_p90_ms",
    "excess_p99_ms", "floor_p50_ms", "floor_p99_ms", "slo_attained", "hit_rate", "shed",
    "shed_with_retry_after", "failed",
}  # fmt: skip


@pytest.mark.timeout(180)  # ~50 s here: four fleets and gateways, arms of 5 s plus draining
def test_bench_critical_quick_runs_and_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    arms = ["no-tenants", "priority", "pinned", "control"]
    assert main(["--quick", "--arms", ",".join(arms), "--out", str(out)]) == 0

    data = json.loads(out.read_text())
    [run] = data["runs"]
    assert (run["seed"], run["engine"]) == (1, "default")
    assert data["settings"]["engines"]["default"]["engine_model"] == "steps"
    assert data["settings"]["engines"]["default"]["scheduling_policy"] == "priority"
    assert list(run["arms"]) == arms
    assert run["not_run"] == {}
    seed = data["settings"]["seeds"]["1"]
    requests = seed["measured_requests"]
    assert 0 < requests < seed["requests"]  # the warm-up is replayed, not counted
    assert seed["load"]["utilisation_round_robin"] > 0
    assert run["floor"]["critical"]["p99_ms"] >= run["floor"]["critical"]["p50_ms"] > 0
    for name, arm in run["arms"].items():
        groups = arm["groups"]
        assert set(groups) >= {"critical", "standard", "all", "voice", "agent", "chat", "bulk"}
        assert groups["all"]["requests"] == requests, name
        assert groups["critical"]["requests"] + groups["standard"]["requests"] == requests
        for group in ("critical", "standard", "all"):
            g = groups[group]
            assert set(g) >= CLASS_FIELDS, (name, group)
            assert g["shed_with_retry_after"] <= g["shed"], name
            assert g["ok"] + g["shed"] + g["failed"] == g["requests"], (name, group)
            assert 0 <= g["hit_rate"] <= 1, (name, group)
            assert 0 <= g["slo_attained"] <= 1, (name, group)
            assert g["ttft_p50_ms"] >= g["excess_p50_ms"], (name, group)  # the floor is >= 0
        assert set(arm["pools"]) == {"hbm-only", "offload"}, name
        assert arm["config"] is not None, name
    pinned = run["arms"]["pinned"]["config"]
    assert [p.get("pinned", False) for p in pinned["pools"]] == [True, False]
    assert not any(k in p for p in pinned["pools"] for k in ("admission", "lend_below"))
    priority = run["arms"]["priority"]["config"]
    assert not any(p.get("pinned") for p in priority["pools"])
    # every cachelane arm declares the engines' policy, which sends the classes as priority
    for name in arms:
        config = parse_config(run["arms"][name]["config"])
        assert all(p.engine_priority for p in config.pools), name
    assert run["arms"]["no-tenants"]["config"]["flow_control"] == {"enabled": False}
    assert run["arms"]["pinned"]["critical_placement"]["hbm-only"]["requests"] >= 0
    # no peer ran: NaN against them; the control arm against no-tenants only
    assert set(run["goal_ratios"]) == {"priority", "pinned", "control"}
    assert data["wall_time_s"] > 0
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.timeout(120)
def test_an_arm_whose_sims_cannot_start_is_reported_and_the_others_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each arm starts its own sims: when one arm's cannot listen (its port taken meanwhile), that
    arm is reported as not run and the next arm still runs."""
    fleet = critical.fleet_on_free_ports()
    monkeypatch.setattr(critical, "fleet_on_free_ports", lambda: fleet)
    taken = socket.socket()
    real_run_arm = critical.run_arm

    def run_arm(arm: str, run: critical.ArmRun) -> object:
        if arm == "no-tenants":  # hold one replica's port while this arm's sims start
            port = int(fleet.hbm_only[0].rsplit(":", 1)[1])
            taken.bind(("127.0.0.1", port))
            taken.listen()
            try:
                return real_run_arm(arm, run)
            finally:
                taken.close()
        return real_run_arm(arm, run)

    monkeypatch.setattr(critical, "run_arm", run_arm)
    out = tmp_path / "x.json"
    assert main(["--quick", "--arms", "no-tenants,control", "--out", str(out)]) == 1
    [run] = json.loads(out.read_text())["runs"]
    assert "no-tenants" in run["not_run"]
    assert list(run["arms"]) == ["control"]
