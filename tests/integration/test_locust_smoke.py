"""Locust headless for a few seconds through a real gateway in front of a simulated fleet.

Checks that every shape streams without a failure, that Locust's request statistics hold only
requests (TTFT and hit rate are kept beside them, not as fake requests that would inflate the
Aggregated row), and that TTFT and the hit rate are reported per shape; no speed is asserted.
"""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.bench.processes import SimFleetSettings, gateway, sim_fleet

REPO = Path(__file__).resolve().parents[2]
RUN_S = 4  # long enough for every user class to send a few turns
LOCUST_TIMEOUT_S = 60  # start-up, RUN_S, and the stop timeout, on a loaded machine
SHAPES = {"chat", "agentic", "rag", "unique", "shared_system", "voice"}


def _locust() -> list[str]:
    exe = shutil.which("locust", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "locust"]


@pytest.mark.timeout(LOCUST_TIMEOUT_S + 60)
def test_locust_headless_records_ttft_and_cached_tokens(tmp_path: Path) -> None:
    settings = SimFleetSettings(replicas=2, hbm_capacity_tokens=200_000, time_factor=0.02)
    with sim_fleet(settings, tmp_path) as fleet, gateway(fleet.urls, "cache_aware", tmp_path) as gw:
        args = [
            *_locust(),
            "-f", str(REPO / "loadtest" / "locust" / "locustfile.py"),
            "--headless", "-u", "6", "-r", "6", "-t", f"{RUN_S}s",
            "--stop-timeout", "5",
            "--host", gw.url,
            "--csv", str(tmp_path / "locust"),
            "--json-file", str(tmp_path / "locust"),
            "--only-summary",
            "--api-key", "unused-by-an-open-gateway",
        ]  # fmt: skip
        done = subprocess.run(
            args,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=LOCUST_TIMEOUT_S,
            check=False,
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    with (tmp_path / "locust_stats.csv").open() as f:
        stats_rows = list(csv.DictReader(f))
    rows = [r for r in stats_rows if r["Name"] != "Aggregated"]
    assert {r["Type"] for r in rows} == {"POST"}, "only requests in Locust's request stats"
    assert {r["Name"] for r in rows} == SHAPES
    assert sum(int(r["Failure Count"]) for r in rows) == 0, rows
    aggregated = next(r for r in stats_rows if r["Name"] == "Aggregated")
    assert int(aggregated["Request Count"]) == sum(int(r["Request Count"]) for r in rows)

    with (tmp_path / "locust_outcomes.csv").open() as f:
        outcomes = {r["shape"]: r for r in csv.DictReader(f)}
    assert set(outcomes) == SHAPES
    for shape, row in outcomes.items():
        assert int(row["requests"]) > 0, shape
        assert float(row["ttft_p50_ms"]) > 0, shape
        assert int(row["prompt_tokens"]) > 0, shape
        assert 0.0 <= float(row["hit_rate"]) <= 1.0, shape
    stats = json.loads((tmp_path / "locust.json").read_text())
    assert {s["method"] for s in stats} == {"POST"}
    assert "prefix hit rate" in done.stderr and "TTFT p50" in done.stderr
