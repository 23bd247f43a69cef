"""loadtest/bench/route_parity_report.py: what counts as the same routing, and when a concurrent
ratio is inside the noise."""

from __future__ import annotations

import dataclasses

from loadtest.bench.replay import Summary, summarize
from loadtest.bench.route_parity_report import Decision, compare, concurrent_ratios
from loadtest.workloads.traces import TraceRecord


def _record(conversation: str | None) -> TraceRecord:
    return {
        "t_s": 0.0,
        "tenant": "rag",
        "endpoint": "chat",
        "max_tokens": 1,
        "conversation": conversation,
        "messages": [],
    }


def test_an_estimate_shifted_alike_everywhere_is_not_a_routing_difference() -> None:
    before = [
        Decision("hbm-0", "cold", "0", "", "fixed=3.0,queue=0.0,prefill=50.0"),
        Decision("hbm-0", "hbm_hit", "1024", "", "fixed=3.0,queue=0.0,prefill=10.0"),
        Decision("tiered-1", "cold", "0", "1", "fixed=3.0,queue=0.0,prefill=70.0"),
    ]
    after = [
        dataclasses.replace(before[0], estimate="fixed=3.0,queue=0.0,prefill=53.4"),
        dataclasses.replace(before[1], estimate="fixed=3.0,queue=0.0,prefill=13.4"),
        dataclasses.replace(before[2], replica="hbm-1", remote_write=""),
    ]
    cmp = compare([_record(None), _record("chat-1"), _record(None)], before, after)
    assert (cmp.requests, cmp.same_replica, cmp.same_routing, cmp.same_estimate) == (3, 2, 2, 1)
    assert cmp.first_difference == 2
    assert [d["index"] for d in cmp.differences] == [2]
    assert cmp.estimate_deltas_ms == {
        "fixed": [0.0, 0.0],
        "prefill": [3.4, 3.4],
        "queue": [0.0, 0.0],
    }


def test_a_ratio_is_within_noise_only_inside_a_commits_own_spread() -> None:
    base = summarize([], 1.0)

    def runs(*p50: float) -> list[Summary]:
        return [dataclasses.replace(base, hit_rate=0.5, ttft_p50_ms=v, ttft_p90_ms=v) for v in p50]

    inside = concurrent_ratios({"before": runs(100, 110), "after": runs(105, 108)})
    assert inside["ttft_p50_ms"]["within"] and inside["hit_rate"]["ratio"] == 1.0
    outside = concurrent_ratios({"before": runs(100, 102), "after": runs(130, 131)})
    assert not outside["ttft_p50_ms"]["within"]
