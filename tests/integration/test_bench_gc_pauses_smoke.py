"""`python -m loadtest.bench.gc_pauses` end to end, shortened: a real sim fleet, a real gateway
with the timing hook. Checks that it runs, that the hook reports, and the JSON's shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.bench.gc_pauses import main

pytestmark = pytest.mark.slow  # `make check` leaves it out: a benchmark smoke

BENCH_TIMEOUT_S = 120  # ~15 s here


@pytest.mark.timeout(BENCH_TIMEOUT_S)
def test_bench_gc_pauses_runs_and_times_full_collections(tmp_path: Path) -> None:
    out = tmp_path / "bench_gc_pauses.json"
    assert main(["--duration-s", "4", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["label"] == "cachelane:cache_aware"
    assert row["requests"] > 0 and row["errors"] == 0
    # the gateway's start-up collection (before its heap is frozen) is timed at least
    assert row["full_collections"] == len(row["pauses_ms"]) >= 1
    assert all(p >= 0 for p in row["pauses_ms"])
