"""`python -m loadtest.bench.family_critical --quick` with cachelane's three arms: a drawn tiered
fleet of real sims (one per arm), real gateways with the tenants' keys. Checks that it runs and
that the JSON has its shape; the numbers are the benchmark's job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.bench.family_critical import draw, main

pytestmark = pytest.mark.slow  # `make check` leaves it out: a benchmark smoke


def test_a_member_is_a_tiered_fleet_with_a_third_hbm_only() -> None:
    m = draw(3, 1, 5.0, 2.0)
    assert 1 <= m.hbm_only < m.fleet.replicas and m.fleet.cpu_tokens >= 2 * m.fleet.hbm_tokens
    assert {r["tenant"] for r in m.trace} == {"voice", "agent", "chat", "bulk"}
    assert m.floor.p("critical", 99) > 0 and 0.3 < m.load < 1.2


@pytest.mark.timeout(240)  # ~45 s here: three fleets and gateways, arms of 7 s plus draining
def test_bench_family_critical_quick_runs_and_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "fc.json"
    assert main(["--quick", "--arms", "no-tenants,priority,pinned", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    [member] = data["members"]
    assert set(member["arms"]) == {"no-tenants", "priority", "pinned"}
    for arm in member["arms"].values():
        assert arm["all"]["failed"] == 0
        assert arm["critical"]["requests"] + arm["standard"]["requests"] == arm["all"]["requests"]
        assert arm["critical"]["ttft_p99_ms"] >= arm["critical"]["excess_p99_ms"]
    ratios = member["ratios"]["pinned"]
    assert ratios["critical_ttft_p99_vs_no_tenants"] > 0  # no peer ran: against no tenants only
    assert {g["goal"] for g in data["goals"]} >= {"worst critical_ttft_p99_vs_no_tenants"}
    assert "| c00 |" in out.with_suffix(".md").read_text()
