"""critical_traces.ideal_floor: each request's own prefill with a perfect cache and no queue."""

from __future__ import annotations

import random

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
