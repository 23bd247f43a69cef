"""loadtest/bench/family*.py: members drawn from ranges, and the ratios the family is judged by."""

from __future__ import annotations

import math

import pytest

from loadtest.bench import family_members, family_stats
from loadtest.bench.family_stats import ArmStats


def stats(arm: str, hit: float, ttft: float, excess: float) -> ArmStats:
    return ArmStats(
        arm=arm,
        requests=10,
        failed=0,
        hit=hit,
        hit_over_ideal=1.0,
        ttft_ms={"p50": ttft / 2, "p90": ttft * 0.9, "p99": ttft},
        excess_ms={"p50": excess / 2, "p90": excess * 0.9, "p99": excess},
        max_over_mean=1.0,
        est_error_p50=None,
        est_error_p90=None,
        elapsed_s=1.0,
    )


def test_a_member_is_the_same_for_a_seed_and_index() -> None:
    a = family_members.draw_member(3, 7, 60, None)
    b = family_members.draw_member(3, 7, 60, None)
    assert a.describe() == b.describe()
    assert a.trace == b.trace
    assert family_members.draw_member(4, 7, 60, None).describe() != a.describe()


@pytest.mark.parametrize("index", range(12))
def test_every_drawn_fleet_is_in_its_ranges(index: int) -> None:
    m = family_members.draw_member(index, 1, 80, None)
    f = m.fleet
    lo, hi = family_members.REPLICAS
    assert lo <= f.replicas <= hi
    assert 512 <= f.max_num_batched_tokens <= 8192
    assert f.long_prefill_token_threshold in (0, f.max_num_batched_tokens // 4)
    assert 0.010 <= f.decode_step_s <= 0.040
    assert f.scheduling_policy in ("fcfs", "priority")
    assert f.cpu_tokens == 0 or f.cpu_tokens >= 2 * f.hbm_tokens
    # the load is what the prefill rate was set for, unless the rate hit its bounds
    pmin, pmax = family_members.PREFILL_TOKENS_PER_S
    if pmin < f.prefill_tokens_per_s < pmax:
        assert abs(m.load - family_members.realised_load(m.trace, f)) < 1e-9
        assert 0.25 <= m.load <= 0.95
    # the floor is known for every request, and no prompt outgrows a replica's HBM
    assert all(x is not None and x > 0 for x in m.floor.per_request)
    assert 0 < m.ideal_hit < 1


def test_without_the_public_traces_a_mooncake_member_takes_a_project_trace() -> None:
    m = family_members.draw_member(1, 1, 40, None)  # ROTATION[1] is a Mooncake trace
    assert family_members.ROTATION[1].startswith("mooncake:")
    assert m.trace_name in family_members.PROJECT_TRACES


def test_ratios_are_against_the_lower_peer_and_hit_against_the_higher() -> None:
    arms = {
        "quickstart": stats("quickstart", 0.50, 200.0, 100.0),
        "vllm": stats("vllm", 0.45, 400.0, 50.0),
        "sglang": stats("sglang", 0.55, 100.0, 200.0),
    }
    ratios = family_stats.ratios_to_peers(arms)
    assert set(ratios) == {"quickstart"}
    q = ratios["quickstart"]
    assert q["ttft_p99"] == pytest.approx(2.0)  # 200 / sglang's 100
    assert q["excess_p99"] == pytest.approx(2.0)  # 100 / vllm's 50
    assert q["hit_points"] == pytest.approx(-5.0)  # 0.50 - sglang's 0.55


def test_excess_under_a_millisecond_counts_as_one() -> None:
    arms = {"told": stats("told", 0.5, 10.0, 0.1), "vllm": stats("vllm", 0.5, 10.0, 0.0)}
    assert family_stats.ratios_to_peers(arms)["told"]["excess_p99"] == 1.0


def test_no_peer_no_ratio() -> None:
    assert family_stats.ratios_to_peers({"told": stats("told", 0.5, 1.0, 1.0)}) == {}


def test_the_summary_takes_the_median_and_the_worst_decile() -> None:
    per_member = [
        {"quickstart": {**dict.fromkeys(family_stats.RATIO_KEYS, 0.5 + i / 10), "hit_points": -i}}
        for i in range(11)
    ]
    summary = family_stats.family_summary(per_member)
    q = summary["quickstart"]
    assert q["excess_p99"]["median"] == pytest.approx(1.0)
    assert q["excess_p99"]["worst"] == pytest.approx(1.5)
    assert 1.3 <= q["excess_p99"]["worst_decile"] <= 1.5
    assert q["hit_points"]["worst"] == -10 and q["hit_points"]["median"] == -5
    verdicts = {
        (a, k): met for a, k, _, _, _, met in family_stats.goal_verdicts(per_member, summary)
    }
    assert verdicts[("quickstart", "every member: excess_p99")] is False
    assert not any(a == "told" for a, _ in verdicts)  # no told arm ran: no verdict on it
    assert not math.isnan(q["ttft_p90"]["median"])
