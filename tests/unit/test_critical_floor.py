"""critical_traces.ideal_floor: each request's own prefill with a perfect cache and no queue."""

from __future__ import annotations

import dataclasses
import random

import pytest

from loadtest.sim.steps import StepSettings
from loadtest.workloads import critical_traces as ct
from loadtest.workloads.traces import TraceRecord, words_text


def record(t_s: float, tenant: str, prompt: str) -> TraceRecord:
    return {
        "t_s": t_s,
        "tenant": tenant,
        "endpoint": "completions",
        "max_tokens": 4,
        "conversation": None,
        "prompt": prompt,
    }


def test_a_prefix_seen_before_is_free_and_a_first_use_is_not() -> None:
    rng = random.Random(0)
    shared = words_text(rng, 1_600)
    first = record(0.0, "agent", shared + " step one " + words_text(rng, 100))
    again = record(1.0, "voice", shared + " step two " + words_text(rng, 100))  # any tenant
    floor = ct.ideal_floor([again, first], 1_000.0, model="m")  # sorted by arrival inside
    cold, warm = floor.ttft_ms["critical"]
    assert cold > 1_600  # ms at 1,000 tokens/s: the whole prompt
    assert warm < 200  # only what follows the shared prefix, to the block
    assert floor.ttft_ms["all"] == [cold, warm]
    assert floor.p("critical", 0) == min(cold, warm) and floor.p("critical", 100) == cold


def test_on_a_step_engine_the_floor_adds_each_step_s_fixed_cost() -> None:
    steps = StepSettings(
        prefill_tokens_per_s=1_000.0, max_num_batched_tokens=500, step_overhead_s=0.01
    )
    assert ct.alone_ms(1_200, 1_000.0, None) == pytest.approx(1_200)
    # alone: three steps of at most 500 tokens, each 10 ms on top of its tokens
    assert ct.alone_ms(1_200, 1_000.0, steps) == pytest.approx(1_200 + 3 * 10)
    threshold = dataclasses.replace(steps, long_prefill_token_threshold=100)
    assert ct.alone_ms(1_200, 1_000.0, threshold) == pytest.approx(1_230)  # lifted when alone


def test_the_floor_per_request_is_in_trace_order_and_skips_the_warm_up() -> None:
    rng = random.Random(1)
    late = record(2.0, "chat", words_text(rng, 300))
    early = record(0.5, "bulk", words_text(rng, 300))
    floor = ct.ideal_floor([late, early], 1_000.0, model="m", since_s=1.0)
    assert floor.per_request[1] is None  # before since_s
    assert floor.per_request[0] == floor.ttft_ms["standard"][0] == floor.ttft_ms["all"][0]
