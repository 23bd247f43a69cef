"""The benchmark's extra traces: seeded, sorted, and shaped as their docstrings say."""

from __future__ import annotations

import itertools

from loadtest.workloads import scenarios, traces

BOUND = traces.ServiceBound()


def test_voice_trace_is_seeded_and_calls_grow_turn_by_turn() -> None:
    a = scenarios.voice_trace(rate_per_s=3, duration_s=20, seed=2)
    assert a == scenarios.voice_trace(rate_per_s=3, duration_s=20, seed=2)
    assert a and all(r["tenant"] == scenarios.VOICE_TENANT for r in a)
    assert [r["t_s"] for r in a] == sorted(r["t_s"] for r in a)
    by_call: dict[str, list[traces.TraceRecord]] = {}
    for r in a:
        assert r["conversation"] is not None
        by_call.setdefault(r["conversation"], []).append(r)
    for turns in by_call.values():
        for earlier, later in itertools.pairwise(turns):
            assert later["messages"][: len(earlier["messages"])] == earlier["messages"]
    assert traces.ideal_hit_rate(a) > 0.3  # one shared system prompt plus growing calls


def test_critical_trace_puts_the_burst_in_the_middle_half() -> None:
    trace = scenarios.critical_trace(
        voice_rate_per_s=2, burst_rate_per_s=10, duration_s=20, seed=1, bound=BOUND
    )
    standard = [r for r in trace if r["tenant"] != scenarios.VOICE_TENANT]
    voice = [r for r in trace if r["tenant"] == scenarios.VOICE_TENANT]
    assert standard and voice
    assert all(5 <= r["t_s"] < 15 for r in standard)
    assert [r["t_s"] for r in trace] == sorted(r["t_s"] for r in trace)
    assert {r["max_tokens"] for r in trace} == {traces.MAX_TOKENS}  # per-replica counting


def test_reuse_mixes_differ_in_ideal_hit_rate() -> None:
    low = traces.generate(scenarios.LOW_REUSE_MIX, rate_per_s=10, duration_s=20, seed=1)
    high = traces.generate(scenarios.HIGH_REUSE_MIX, rate_per_s=10, duration_s=20, seed=1)
    assert traces.ideal_hit_rate(low) < traces.ideal_hit_rate(high)
