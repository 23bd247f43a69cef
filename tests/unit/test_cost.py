import pytest

from routing.cost import (
    KV_BYTES_PER_TOKEN,
    PCIE_GBPS,
    PREFILL_TOKENS_PER_S,
    REMOTE_FIXED_S,
    REMOTE_GBPS,
    CostTerms,
    Load,
    Overlap,
    PoolCosts,
    Queued,
    estimate,
)
from routing.prefill_steps import queue_wait_s

COSTS = PoolCosts(
    fixed_s=0.0, step_s=0.0
)  # the per-token terms alone; the overheads have their tests


@pytest.mark.parametrize(
    ("overlap", "load", "ttft_s"),
    [
        (Overlap(3000), Load(), 3000 / PREFILL_TOKENS_PER_S + 0 / PREFILL_TOKENS_PER_S),
        (Overlap(3000, hbm_tokens=3000), Load(), 0.0),
        (Overlap(3000, hbm_tokens=2000), Load(), 1000 / PREFILL_TOKENS_PER_S),
        (
            Overlap(3000, cpu_tokens=3000),
            Load(),
            3000 * KV_BYTES_PER_TOKEN / (PCIE_GBPS * 1e9),
        ),
        (
            Overlap(3000, cpu_tokens=3000),
            Load(swaps_in_flight=1),
            2 * 3000 * KV_BYTES_PER_TOKEN / (PCIE_GBPS * 1e9),
        ),
        (
            Overlap(30_000, remote_tokens=30_000),
            Load(),
            REMOTE_FIXED_S + 30_000 * KV_BYTES_PER_TOKEN / (REMOTE_GBPS * 1e9),
        ),
        (Overlap(300, remote_tokens=300), Load(), 300 / PREFILL_TOKENS_PER_S),
        (Overlap(0), Load(pending_prefill_tokens=60_000), 2.0),
    ],
    ids=[
        "cold",
        "all-hbm",
        "hbm-prefix",
        "cpu-swap",
        "cpu-swap-shared-pcie",
        "remote-fetch-beats-recompute",
        "remote-too-small-recompute",
        "queue-only",
    ],
)
def test_estimate(overlap: Overlap, load: Load, ttft_s: float) -> None:
    assert estimate(overlap, load, COSTS).ttft_s == pytest.approx(ttft_s, rel=1e-6, abs=1e-4)


def test_remote_fetch_flag() -> None:
    assert estimate(Overlap(30_000, remote_tokens=30_000), Load(), COSTS).remote_fetch
    assert not estimate(Overlap(300, remote_tokens=300), Load(), COSTS).remote_fetch


def test_running_decodes_take_a_token_of_each_of_its_steps() -> None:
    """100 running decodes take 100 tokens of each step's 8,192-token budget: 20k tokens still
    take 3 steps, each also computing the 100 decode tokens (in its prefill, not a queue: the
    decodes of the one-at-a-time model were a wait before it)."""
    idle = estimate(Overlap(20_000), Load(), COSTS)
    busy = estimate(Overlap(20_000), Load(in_flight=100), COSTS)
    assert idle.queue_s == busy.queue_s == 0
    assert busy.prefill_steps == 3
    assert busy.prefill_s - idle.prefill_s == pytest.approx(3 * 100 / PREFILL_TOKENS_PER_S)


def test_fixed_overhead_is_added_once() -> None:
    with_fixed = estimate(Overlap(3000), Load(), PoolCosts(fixed_s=0.05, step_s=0.0))
    assert with_fixed.ttft_s == pytest.approx(0.05 + 3000 / PREFILL_TOKENS_PER_S)


def test_each_step_costs_its_forward_pass() -> None:
    """20k tokens are 3 steps of the default 8,192-token budget: 3 step costs."""
    e = estimate(Overlap(20_000), Load(), PoolCosts(fixed_s=0.0, step_s=0.01))
    assert e.prefill_s == pytest.approx(3 * 0.01 + 20_000 / PREFILL_TOKENS_PER_S)
    assert e.steps == e.prefill_steps == 3


def test_progress_on_the_queue_head_shortens_the_wait() -> None:
    """30k tokens queued at 30k tokens/s, of which the replica has worked 0.4 s: 0.6 s left.
    (In steps of 8,192 tokens the last 5,424 share the request's step: its first chunk is
    scheduled 0.181 s before the work ahead ends, and its step computes them.)"""
    load = Load(pending_prefill_tokens=30_000, busy_s=0.4)
    e = estimate(Overlap(0), load, COSTS)
    assert e.queue_s + e.prefill_s == pytest.approx(0.6)
    assert e.queue_s == pytest.approx(0.6 - (30_000 % 8192) / PREFILL_TOKENS_PER_S)
    assert e.queue_tokens == pytest.approx(18_000)
    assert estimate(Overlap(0), Load(pending_prefill_tokens=300, busy_s=5.0), COSTS).queue_s == 0


def test_terms_replace_the_seed() -> None:
    """A replica fitted 10x slower than its pool's constants is estimated 10x slower."""
    seed = CostTerms.seed(COSTS)
    overlap, load = Overlap(3000, cpu_tokens=1000, remote_tokens=0), Load()
    base = estimate(overlap, load, COSTS).ttft_s
    assert estimate(overlap, load, COSTS, seed.scaled(10.0)).ttft_s == pytest.approx(10 * base)
    assert estimate(overlap, load, COSTS, seed).ttft_s == pytest.approx(base)


PER_TOKEN = 1 / PREFILL_TOKENS_PER_S


def test_a_kv_load_overlaps_the_queue_ahead() -> None:
    """0.5 s of prefill queued; the request swaps in for longer than that: it does not wait."""
    swapped = 200_000  # 200k tokens x 128 KiB at 50 GB/s: ~0.52 s of swap-in
    load = Load(pending_prefill_tokens=15_000)  # 0.5 s at 30k tokens/s
    e = estimate(Overlap(swapped + 3000, cpu_tokens=swapped), load, COSTS)
    assert e.swap_s > 0.5
    assert e.queue_s == 0
    cold = estimate(Overlap(3000), load, COSTS)
    assert cold.queue_s + cold.prefill_s == pytest.approx(0.5 + 3000 * PER_TOKEN)


def test_requests_that_reach_the_prefill_later_do_not_delay_it() -> None:
    """Two sent requests of 3k tokens each: one waits now, one still loads its KV for 1 s."""
    queue = (Queued(0.0, 3000), Queued(1.0, 3000))
    load = Load(pending_prefill_tokens=6000, queue=queue)
    assert queue_wait_s(load, 0.0, PER_TOKEN) == pytest.approx(0.1)
    # joining at 1.05 s, just after the second one: it started at 1.0 s and takes 0.1 s
    assert queue_wait_s(load, 1.05, PER_TOKEN) == pytest.approx(0.05)
    assert queue_wait_s(load, 2.0, PER_TOKEN) == 0


def test_a_request_sent_earlier_is_ahead_if_loaded_before_the_prefill_is_free() -> None:
    """3k tokens wait now (0.1 s); 3k more, sent earlier, load until 0.05 s. A request joining
    now waits for both: when the prefill is free the other is loaded, and arrived first. One
    that loads past 0.1 s is not waited for: this one is scheduled while it still loads."""
    loaded_in_time = (Queued(0.0, 3000), Queued(0.05, 3000))
    load = Load(pending_prefill_tokens=6000, queue=loaded_in_time)
    assert queue_wait_s(load, 0.0, PER_TOKEN) == pytest.approx(0.2)
    too_late = Load(pending_prefill_tokens=6000, queue=(Queued(0.0, 3000), Queued(0.15, 3000)))
    assert queue_wait_s(too_late, 0.0, PER_TOKEN) == pytest.approx(0.1)
    # with a priority, a less urgent one loaded in time is overtaken, a more urgent one is not
    urgent = (Queued(0.0, 3000, priority=0), Queued(0.05, 3000, priority=-1))
    assert queue_wait_s(
        Load(pending_prefill_tokens=6000, queue=urgent), 0.0, PER_TOKEN, 0
    ) == pytest.approx(0.2)
    lax = (Queued(0.0, 3000, priority=0), Queued(0.05, 3000, priority=1))
    assert queue_wait_s(
        Load(pending_prefill_tokens=6000, queue=lax), 0.0, PER_TOKEN, 0
    ) == pytest.approx(0.1)


def test_progress_counts_only_for_requests_already_waiting() -> None:
    """0.05 s spent on the head; the one request sent is still loading: no progress on it."""
    loading = Load(pending_prefill_tokens=3000, busy_s=0.05, queue=(Queued(0.2, 3000),))
    assert queue_wait_s(loading, 0.3, PER_TOKEN) == pytest.approx(0.0)
    assert queue_wait_s(loading, 0.25, PER_TOKEN) == pytest.approx(0.05)
    waiting = Load(pending_prefill_tokens=3000, busy_s=0.05, queue=(Queued(-0.1, 3000),))
    assert queue_wait_s(waiting, 0.0, PER_TOKEN) == pytest.approx(0.05)


def test_pending_tokens_of_unknown_requests_wait_now() -> None:
    """Tokens another gateway sent (in pending_prefill_tokens, not in the queue) are ahead."""
    load = Load(pending_prefill_tokens=6000, queue=(Queued(0.5, 3000),))
    assert queue_wait_s(load, 0.0, PER_TOKEN) == pytest.approx(0.1)
    assert queue_wait_s(load, 0.5, PER_TOKEN) == pytest.approx(0.1)  # a tie: the one sent first


def test_an_urgent_request_overtakes_queued_work_that_has_not_started() -> None:
    """Under engine priority (lower first) a critical request (-1) waits for the prefill in
    progress and for work of its own priority, not for standard (0) work still queued."""
    head = Queued(-0.2, 3000, priority=0)  # prefilling for 0.05 s: 0.05 s left
    queued = (head, Queued(-0.1, 6000, priority=0), Queued(-0.05, 1500, priority=-1))
    load = Load(pending_prefill_tokens=10_500, busy_s=0.05, queue=queued)
    assert queue_wait_s(load, 0.0, PER_TOKEN, priority=-1) == pytest.approx(0.05 + 0.05)
    assert queue_wait_s(load, 0.0, PER_TOKEN, priority=0) == pytest.approx(0.05 + 0.2 + 0.05)
    # no priority: first come, first served, as before
    assert queue_wait_s(load, 0.0, PER_TOKEN) == queue_wait_s(load, 0.0, PER_TOKEN, priority=0)


def test_less_urgent_work_that_starts_before_the_request_joins_is_waited_for() -> None:
    """A standard request that reaches the prefill while it is free starts before a critical one
    that is still loading its KV: the critical one waits for the rest of it."""
    load = Load(pending_prefill_tokens=3000, queue=(Queued(0.1, 3000, priority=0),))
    assert queue_wait_s(load, 0.15, PER_TOKEN, priority=-1) == pytest.approx(0.05)
    # joining before it: the critical one goes first
    assert queue_wait_s(load, 0.05, PER_TOKEN, priority=-1) == 0


def test_work_of_unknown_priority_counts_as_ahead() -> None:
    """Tokens another gateway sent may carry any priority: counted as ahead."""
    load = Load(pending_prefill_tokens=6000, queue=(Queued(-0.1, 3000, priority=0),))
    assert queue_wait_s(load, 0.0, PER_TOKEN, priority=-1) == pytest.approx(0.1)


def test_a_prefill_that_starts_while_another_loads_charges_it_the_wait() -> None:
    """A request still fetching its KV joins the queue in 0.1 s; a 3,000-token prefill taking
    the free prefill now (0.1 s at the default rate) runs until 0.1 s: nothing to charge; a
    6,000-token one until 0.2 s: the loading one waits 0.1 s for it."""
    loading = Load(pending_prefill_tokens=3000, queue=(Queued(0.1, 3000),))
    assert estimate(Overlap(3000), loading, COSTS).cuts_in_s == pytest.approx(0.0)
    long = estimate(Overlap(6000), loading, COSTS)
    assert long.queue_s == 0  # it goes first: the other is not there yet
    assert long.cuts_in_s == pytest.approx(6000 * PER_TOKEN - 0.1)
    # joined already (or ahead of it): waited for, not charged
    joined = Load(pending_prefill_tokens=3000, queue=(Queued(-0.01, 3000),))
    assert estimate(Overlap(6000), joined, COSTS).cuts_in_s == 0


def test_the_wait_added_to_others_counts_overtaken_and_cut_in_requests() -> None:
    """others_wait_s: its own tokens' time for each request overtaken, plus the cut-in waits."""
    e = estimate(
        Overlap(6000), Load(pending_prefill_tokens=3000, queue=(Queued(0.1, 3000),)), COSTS
    )
    assert e.others_wait_s == pytest.approx(e.cuts_in_s) and e.cuts_in_s > 0
    head = Queued(-0.2, 3000, priority=0)  # sent after the step under way was formed:
    queued = Load(pending_prefill_tokens=9000, busy_s=0.05, queue=(head, Queued(-0.01, 6000)))
    urgent = estimate(Overlap(3000), queued, COSTS, priority=-1)
    assert urgent.overtakes == 1
    # the overtaken one shares its steps: it waits for the urgent one's own tokens
    assert urgent.others_wait_s == pytest.approx(3000 * PER_TOKEN)
