"""`python -m loadtest.bench.costs` end to end with a short trace: a simulated fleet and a gateway
as processes from one config, the account against the simulator's counters, `cachelane report`
with its chart. Checks that it runs and what it writes; the numbers are docs/costs.md's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.bench_cli import run_ok

pytestmark = pytest.mark.slow  # `make check` leaves it out: a benchmark smoke

BENCH_TIMEOUT_S = 90  # ~15 s here: two process start-ups, 30 requests at 8 req/s, the report


@pytest.mark.timeout(BENCH_TIMEOUT_S + 10)
def test_bench_costs_runs_and_reports(tmp_path: Path) -> None:
    png = tmp_path / "costs.png"
    args = [
        "--requests", "30", "--seed", "2", "--out-dir", str(tmp_path), "--png", str(png),
    ]  # fmt: skip
    run_ok(["-m", "loadtest.bench.costs", *args], BENCH_TIMEOUT_S)
    result = json.loads((tmp_path / "costs.json").read_text())
    assert result["requests"] == 30 and result["errors"] == 0
    checks = {c["quantity"]: c for c in result["checks"]}
    for exact in ("streamed requests", "prompt tokens", "cached tokens"):
        assert checks[exact]["gateway"] == checks[exact]["simulator"], checks[exact]
    assert "Where the cost of offloading landed" in result["report"]
    assert "cache hits avoided" in result["report"]
    assert png.stat().st_size > 0
