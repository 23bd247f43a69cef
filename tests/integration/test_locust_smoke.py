"""Locust headless for a few seconds through a real gateway in front of a simulated fleet.

Checks that every shape streams without a failure, that Locust's request statistics hold only
requests (TTFT and hit rate are kept beside them, not as fake requests that would inflate the
Aggregated row), and that TTFT and the hit rate are reported per shape; no speed is asserted.

Locust runs as `cachelane locust` from a copy of the packages as a wheel installs them (their .py
files, nothing else of the checkout) in a directory outside the checkout, so the scenarios run
from an installed package; `cachelane locust --help` lists the scenarios' options; and
`locust -f loadtest/locust/locustfile.py` still runs from the checkout. Locust monkey-patches the
standard library with gevent when imported: every run is a subprocess.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.bench.processes import SimFleetSettings, gateway, sim_fleet

pytestmark = pytest.mark.slow  # `make check` leaves it out: Locust runs against a fleet

REPO = Path(__file__).resolve().parents[2]
RUN_S = 4  # long enough for every user class to send a few turns
LOCUST_TIMEOUT_S = 60  # start-up, RUN_S, and the stop timeout, on a loaded machine
SHAPES = {"chat", "agentic", "rag", "unique", "shared_system", "voice"}
PACKAGES = ("gateway", "routing", "loadtest")  # pyproject.toml [tool.setuptools.packages.find]
SCENARIO_OPTIONS = ("--model", "--seed", "--api-key", "--voice-api-key", "--shapes")


def _locust() -> list[str]:
    exe = shutil.which("locust", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "locust"]


def _installed_copy(tmp_path: Path) -> dict[str, str]:
    """The packages' .py files (what the wheel holds) in tmp_path/site; the environment that
    imports them from there (PYTHONPATH comes before the editable install's finder)."""
    site = tmp_path / "site"
    for package in PACKAGES:
        shutil.copytree(
            REPO / package,
            site / package,
            ignore=lambda _, names: [n for n in names if n == "__pycache__" or n.endswith(".pyc")],
        )
    return {**os.environ, "PYTHONPATH": str(site)}


def _run(
    command: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=LOCUST_TIMEOUT_S,
        check=False,
    )


def _cachelane_locust(
    *args: str, env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    """`cachelane locust` from the installed copy in `env` (_installed_copy)."""
    return _run([sys.executable, "-m", "gateway", "locust", *args], cwd, env)


def test_cachelane_locust_runs_the_installed_scenarios_and_lists_their_options(
    tmp_path: Path,
) -> None:
    env = _installed_copy(tmp_path)
    where = _cachelane_locust("--print-path", "--shapes", env=env, cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    files = where.stdout.strip().split(",")
    assert files == [
        str(tmp_path / "site" / "loadtest" / "locust" / name)
        for name in ("locustfile.py", "shapes.py")
    ]

    help_page = _cachelane_locust("--help", env=env, cwd=tmp_path)
    assert help_page.returncode == 0, help_page.stderr
    assert help_page.stdout.startswith("Usage: cachelane locust")
    for option in (*SCENARIO_OPTIONS, "--headless", "--host"):
        assert f"{option} " in help_page.stdout, option

    listed = _cachelane_locust("--list", env=env, cwd=tmp_path)  # loads the scenarios
    assert listed.returncode == 0, listed.stderr
    assert "VoiceUser" in listed.stdout and "ChatUser" in listed.stdout

    refused = _cachelane_locust("-f", "other.py", env=env, cwd=tmp_path)
    assert refused.returncode == 2 and "locust -f" in refused.stderr


def test_locust_runs_the_checkout_locustfile() -> None:
    listed = _run(
        [*_locust(), "-f", str(REPO / "loadtest" / "locust" / "locustfile.py"), "--list"], REPO
    )
    assert listed.returncode == 0, listed.stderr
    assert "AgentUser" in listed.stdout and "RagUser" in listed.stdout


@pytest.mark.timeout(LOCUST_TIMEOUT_S + 60)
def test_locust_headless_records_ttft_and_cached_tokens(tmp_path: Path) -> None:
    settings = SimFleetSettings(replicas=2, hbm_capacity_tokens=200_000, time_factor=0.02)
    with sim_fleet(settings, tmp_path) as fleet, gateway(fleet.urls, "cache_aware", tmp_path) as gw:
        done = _cachelane_locust(
            "--headless", "-u", "6", "-r", "6", "-t", f"{RUN_S}s",
            "--stop-timeout", "5",
            "--host", gw.url,
            "--csv", str(tmp_path / "locust"),
            "--json-file", str(tmp_path / "locust"),
            "--only-summary",
            "--api-key", "unused-by-an-open-gateway",
            env=_installed_copy(tmp_path), cwd=tmp_path,
        )  # fmt: skip
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
    # the per-shape table comes last, after Locust's shutdown and its own statistics, as a table
    ours = done.stderr.find("Time to first token and prefix hit rate per traffic shape")
    assert ours > done.stderr.find("Shutting down (exit code 0)") >= 0, done.stderr[-3000:]
    table = done.stderr[ours:]
    assert all(f"\n{shape:<12} " in table for shape in SHAPES)


@pytest.mark.timeout(LOCUST_TIMEOUT_S + 60)
def test_locust_replays_a_mooncake_trace_once_at_its_offsets(tmp_path: Path) -> None:
    """--trace replays every record of a Mooncake-format file exactly once (TraceUser alone),
    and the records that share block ids hit the cache."""
    trace = tmp_path / "conversation_trace.jsonl"
    records = [
        {"timestamp": 100 * i, "input_length": 1200, "output_length": 16, "hash_ids": [7, 8, i]}
        for i in range(12)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    settings = SimFleetSettings(replicas=2, hbm_capacity_tokens=200_000, time_factor=0.02)
    with sim_fleet(settings, tmp_path) as fleet, gateway(fleet.urls, "cache_aware", tmp_path) as gw:
        done = _cachelane_locust(
            "--headless", "-u", "4", "-r", "4", "-t", f"{RUN_S}s",
            "--stop-timeout", "5",
            "--host", gw.url,
            "--csv", str(tmp_path / "locust"),
            "--only-summary",
            "--trace", f"mooncake:{trace}@2:10",
            env=_installed_copy(tmp_path), cwd=tmp_path,
        )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with (tmp_path / "locust_outcomes.csv").open() as f:
        outcomes = {r["shape"]: r for r in csv.DictReader(f)}
    assert set(outcomes) == {"trace"}  # the shapes' users did not spawn
    assert int(outcomes["trace"]["requests"]) == 10  # records 2..11, each once
    assert float(outcomes["trace"]["hit_rate"]) > 0.3  # blocks 7 and 8 are shared
