"""Locust headless for a few seconds through a real gateway in front of a simulated fleet.

Checks only that every shape streams without a failure and that TTFT and cached_tokens are
recorded as their own entries; no speed is asserted.
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
        rows = [r for r in csv.DictReader(f) if r["Name"] != "Aggregated"]
    by_type: dict[str, dict[str, dict[str, str]]] = {}
    for row in rows:
        by_type.setdefault(row["Type"], {})[row["Name"]] = row
    assert sum(int(r["Failure Count"]) for r in rows) == 0, rows
    assert set(by_type["POST"]) == SHAPES
    assert set(by_type["TTFT"]) == SHAPES
    assert set(by_type["cached_tokens"]) == SHAPES
    for name, row in by_type["TTFT"].items():
        assert int(row["Request Count"]) > 0, name
        assert float(row["Average Response Time"]) > 0, name
    for name, row in by_type["cached_tokens"].items():
        assert float(row["Average Content Size"]) > 0, name  # prompt tokens from usage

    stats = json.loads((tmp_path / "locust.json").read_text())
    ttft = [s for s in stats if s["method"] == "TTFT"]
    assert ttft and all(s["num_failures"] == 0 and s["num_requests"] > 0 for s in ttft)
    assert "prefix hit rate" in done.stderr
