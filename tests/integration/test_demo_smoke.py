"""`cachelane demo` end to end, shortened: real sim fleet, real gateways, real replay.

Checks only that it runs and writes sane results; the timing story is the full demo's job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.bench.processes import free_port_run
from tests.integration.bench_cli import run_ok

pytestmark = pytest.mark.slow  # `make check` leaves it out: the demo end to end

DEMO_TIMEOUT_S = 120  # ~4 s of trace per policy plus process start-up; generous for CI


@pytest.mark.timeout(DEMO_TIMEOUT_S + 10)
def test_demo_runs_and_writes_results(tmp_path: Path) -> None:
    out_dir = tmp_path / "demo"
    # the tier section is the bench's (tests/integration/test_bench_tiers_smoke.py)
    args = ["--duration-s", "4", "--rate", "6", "--replicas", "2", "--seed", "3", "--skip-tiers"]
    port = free_port_run(3)  # the two replicas, then the gateway
    args += ["--port", str(port)]
    run_ok(["-m", "gateway", "demo", *args, "--out-dir", str(out_dir)], DEMO_TIMEOUT_S)

    data = json.loads((out_dir / "demo.json").read_text())
    assert list(data["policies"]) == ["round_robin", "cache_aware"]
    requests = data["trace"]["requests"]
    assert requests > 0
    assert 0 <= data["trace"]["ideal_hit_rate"] <= 1
    for policy, summary in data["policies"].items():
        assert summary["requests"] == requests, policy
        assert summary["errors"] == 0, policy
        assert summary["ok"] == requests, policy
        # the ideal bound, with slack for two prompts racing for one replica's prefill queue
        assert 0 <= summary["hit_rate"] <= data["trace"]["ideal_hit_rate"] + 0.05, policy
        assert summary["prompt_tokens"] > 0
        assert summary["ttft_p50_ms"] > 0 and summary["ttft_p99_ms"] >= summary["ttft_p50_ms"]
        assert sum(summary["per_replica"].values()) == requests
        assert len(summary["per_replica"]) <= 2
    assert data["ratios"]["hit_rate"] is not None
    assert (out_dir / "demo.png").stat().st_size > 0
    assert (out_dir / "trace.jsonl").exists()
    assert data["urls"] == {
        "replicas": [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"],
        "gateway": f"http://127.0.0.1:{port + 2}",
    }
    assert (out_dir / "requests-cache_aware.jsonl").exists()
