"""`python -m loadtest.bench.family --quick` end to end with cachelane's two arms, on a Mooncake-
format trace folder written here: real sim fleets (one per arm), real gateways. Checks that it
runs and that the JSON has its shape; the numbers are the benchmark's job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.bench.family import main

pytestmark = pytest.mark.slow  # `make check` leaves it out: a benchmark smoke


def mooncake_folder(path: Path) -> Path:
    """Both public trace names, each 80 records of a few shared prefixes, Mooncake's format."""
    path.mkdir()
    for name in ("conversation", "synthetic"):
        lines = []
        for i in range(80):
            family = i % 4
            ids = [1000 * family + j for j in range(3)] + [100_000 + i]
            record = {
                "timestamp": 250 * i,
                "input_length": 512 * 3 + 100,
                "output_length": 40,
                "hash_ids": ids,
            }
            lines.append(json.dumps(record))
        (path / f"{name}_trace.jsonl").write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.timeout(300)  # ~60 s here: two members, two arms each, fleets of 2-8 sims
def test_bench_family_quick_runs_and_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "family.json"
    folder = mooncake_folder(tmp_path / "mooncake")
    args = ["--quick", "--arms", "quickstart,told", "--mooncake-dir", str(folder)]
    assert main([*args, "--first-member", "1", "--out", str(out)]) == 0

    data = json.loads(out.read_text())
    names = [m["name"] for m in data["members"]]
    assert names == ["m01-mc-conversation", "m02-mc-synthetic"]
    for member in data["members"]:
        assert member["ideal_hit"] > 0.3  # the folder's records share 3 of 4 blocks
        assert member["floor_ms"]["p50_ms"] > 0
        assert set(member["arms"]) == {"quickstart", "told"}
        for arm in member["arms"].values():
            assert arm["failed"] == 0
            assert 0 < arm["hit"] <= member["ideal_hit"] + 1e-3  # ideal_hit is rounded
            assert arm["ttft_ms"]["p99"] >= arm["ttft_ms"]["p50"] > 0
            assert arm["excess_ms"]["p50"] <= arm["ttft_ms"]["p50"]
        assert member["ratios_to_better_peer"] == {}  # no peer ran
    assert data["summary"] == {} and data["goals"] == []
    assert out.with_suffix(".png").stat().st_size > 0
    table = out.with_suffix(".md").read_text()  # the tables docs/bench/family.md shows
    assert table.count("| quickstart |") == 2 and "m02-mc-synthetic" in table
