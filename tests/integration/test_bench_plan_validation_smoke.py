"""`python -m loadtest.bench.plan_validation` end to end, with tiny set-ups: real sim fleets, real
gateways capturing, the planner on their captures.

Checks that it runs, that every request was captured, and the JSON's shape; the figures are the
benchmark's job (docs/planning.md), and a few seconds say nothing about them. That the replay
routes and hits as the gateway did is tests/integration/test_capture.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.bench_cli import run_ok

pytestmark = pytest.mark.slow  # `make check` leaves it out: a benchmark smoke

BENCH_TIMEOUT_S = 150  # ~40 s here: 3 set-ups of 7 s (5 s of warm-up) plus start-ups


@pytest.mark.timeout(BENCH_TIMEOUT_S + 10)
def test_plan_validation_runs_and_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "plan_validation.json"
    args = [
        "-m", "loadtest.bench.plan_validation",
        "--duration-s", "7", "--out", str(out), "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    done = run_ok(args, BENCH_TIMEOUT_S)
    assert "| set-up | class |" in done.stdout  # the markdown tables docs/planning.md shows

    data = json.loads(out.read_text())
    assert set(data["setups"]) == {"hbm", "cpu", "remote"}
    assert data["remote_lookup_probe_ms"] > 0
    for name, setup in data["setups"].items():
        client = setup["client"]["all"]
        assert client["errors"] == 0, name
        assert setup["captured_requests"] == client["requests"], "one record each"
        counted = setup["measured"]["all"]["requests"]  # after the warm-up
        assert 0 < counted < client["requests"], name
        for kind in ("predicted_whatif", "predicted_same"):
            assert setup[kind]["all"]["requests"] == counted, (name, kind)
        for kind in ("measured", "predicted_whatif", "predicted_same"):
            assert 0 <= setup[kind]["all"]["hit_rate"] <= 1, (name, kind)
    assert {row["setup"] for row in data["rows"]} == {"hbm", "cpu", "remote"}
