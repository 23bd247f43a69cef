"""routing/accounting.py: tier split, TTFT attribution, windows, the remote ledger."""

from __future__ import annotations

import pytest

from routing.accounting import (
    FIELDS,
    OTHER_TENANT,
    CostKey,
    Layers,
    RemoteLedger,
    TierTokens,
    Windows,
    attribute_ttft,
    confirmed_tokens,
    repriced_layers,
    request_fields,
)
from routing.cost import CostTerms, Load, Overlap, PoolCosts, estimate

COSTS = PoolCosts()
TERMS = CostTerms.seed(COSTS)
BULK = CostKey("bulk", "batch", "offload")
WEB = CostKey("web", "standard", "offload")


@pytest.mark.parametrize(
    ("cached", "expected"),
    [
        (None, TierTokens(hbm=1000, cpu=2000, remote=3000, computed=4000)),
        (6000, TierTokens(1000, 2000, 3000, 4000)),
        (5000, TierTokens(1000, 2000, 2000, 5000)),  # shortfall from the remote part first
        (2500, TierTokens(1000, 1500, 0, 7500)),  # then the CPU part
        (400, TierTokens(400, 0, 0, 9600)),  # then HBM
        (7000, TierTokens(2000, 2000, 3000, 3000)),  # surplus: found in HBM
        (20_000, TierTokens(5000, 2000, 3000, 0)),  # capped by the prompt
    ],
    ids=["no-usage", "as-expected", "remote-short", "cpu-short", "hbm-short", "surplus", "cap"],
)
def test_confirmed_tokens(cached: int | None, expected: TierTokens) -> None:
    overlap = Overlap(10_000, hbm_tokens=1000, cpu_tokens=2000, remote_tokens=3000)
    got = confirmed_tokens(overlap, remote_fetch=True, cached_tokens=cached)
    assert got == expected
    assert got.cached + got.computed == 10_000


def test_remote_tokens_recomputed_are_computed() -> None:
    overlap = Overlap(1000, hbm_tokens=0, cpu_tokens=0, remote_tokens=800)
    assert confirmed_tokens(overlap, remote_fetch=False, cached_tokens=None) == TierTokens(
        0, 0, 0, 1000
    )


def test_a_surplus_is_the_remote_run_the_engine_fetched_before_hbm() -> None:
    """The decision expected the remote-held run recomputed; the engine fetched it."""
    overlap = Overlap(4000, hbm_tokens=1000, cpu_tokens=0, remote_tokens=1600)
    assert confirmed_tokens(overlap, remote_fetch=False, cached_tokens=2600) == TierTokens(
        1000, 0, 1600, 1400
    )
    assert confirmed_tokens(overlap, remote_fetch=False, cached_tokens=3000) == TierTokens(
        1400, 0, 1600, 1000
    )


ESTIMATED = Layers(fixed_s=0.003, queue_s=0.017, swap_s=0.02, fetch_s=0.01, prefill_s=0.05)


@pytest.mark.parametrize(
    ("observed_s", "factor"),
    [(0.2, 2.0), (0.1, 1.0), (0.05, 0.5), (0.0, 0.0)],
    ids=["slower", "exact", "faster", "zero"],
)
def test_attribution_scales_every_layer_to_the_observation(
    observed_s: float, factor: float
) -> None:
    got = attribute_ttft(ESTIMATED, observed_s)
    assert got.total_s == pytest.approx(observed_s)
    for name in ("fixed_s", "queue_s", "swap_s", "fetch_s", "prefill_s"):
        assert getattr(got, name) == pytest.approx(getattr(ESTIMATED, name) * factor), name


def test_attribution_of_an_empty_estimate_is_overhead() -> None:
    assert attribute_ttft(Layers(0, 0, 0, 0, 0), 0.02) == Layers(0.02, 0, 0, 0, 0)


def test_repriced_layers_price_the_confirmed_tokens() -> None:
    tokens = TierTokens(hbm=0, cpu=1000, remote=2000, computed=3000)
    priced = repriced_layers(tokens, TERMS, COSTS, swap_share=2.0, queue_s=0.004)
    assert priced.swap_s == pytest.approx(2 * 1000 * TERMS.swap_s_per_token)
    assert priced.fetch_s == pytest.approx(COSTS.remote_fixed_s + 2000 * TERMS.fetch_s_per_token)
    assert priced.prefill_s == pytest.approx(3000 / COSTS.prefill_tokens_per_s)
    assert priced.queue_s == 0.004 and priced.fixed_s == TERMS.fixed_s


def test_request_fields_of_a_swap_shared_with_another() -> None:
    overlap = Overlap(4096, hbm_tokens=1024, cpu_tokens=2048, remote_tokens=0)
    est = estimate(overlap, Load(swaps_in_flight=1), COSTS, TERMS)
    f = request_fields(
        overlap,
        est,
        TERMS,
        COSTS,
        block_size_tokens=16,
        observed_s=est.ttft_s + 0.010,
        cached_tokens=3072,
        prompt_tokens=4096,
    )
    assert set(f) <= set(FIELDS)
    assert f["pcie_bytes"] == 2048 * COSTS.kv_bytes_per_token
    assert f["swap_ins"] == 1 and f["swap_link_sharers"] == 2 and f["shared_swap_ins"] == 1
    assert f["avoided_hbm_s"] == pytest.approx(1024 / COSTS.prefill_tokens_per_s)
    assert f["avoided_cpu_s"] == pytest.approx(2048 / COSTS.prefill_tokens_per_s)
    assert f["hbm_inserted_blocks"] == (4096 - 1024) // 16
    layers = sum(f[k] for k in ("fixed_s", "queue_s", "swap_s", "fetch_s", "prefill_s"))
    assert layers == pytest.approx(f["observed_ttft_s"])
    # the swap was confirmed in full: the layers keep the estimate's proportions
    scale = f["observed_ttft_s"] / est.ttft_s
    assert f["swap_s"] == pytest.approx(est.swap_s * scale)
    assert f["queue_s"] == pytest.approx(est.queue_s * scale)


def test_request_fields_without_a_ttft_attribute_nothing() -> None:
    overlap = Overlap(100)
    est = estimate(overlap, Load(), COSTS, TERMS)
    f = request_fields(
        overlap, est, TERMS, COSTS, block_size_tokens=16, observed_s=None, cached_tokens=0
    )
    assert f["requests"] == 1 and "timed_requests" not in f and "queue_s" not in f


def test_windows_slide_and_expire() -> None:
    w = Windows(bucket_s=10.0, span_s=60.0)
    w.add(0.0, WEB, {"requests": 1})
    w.add(15.0, WEB, {"requests": 2})
    w.add(55.0, BULK, {"requests": 4})
    assert w.totals(59.0, 60.0) == {
        WEB: {**dict.fromkeys(FIELDS, 0.0), "requests": 3.0},
        BULK: {**dict.fromkeys(FIELDS, 0.0), "requests": 4.0},
    }
    assert w.totals(59.0, 10.0)[BULK]["requests"] == 4 and WEB not in w.totals(59.0, 10.0)
    assert w.totals(65.0, 60.0)[WEB]["requests"] == 2  # the bucket of t=0 slid out
    assert w.totals(200.0, 60.0) == {}  # all stale, though never overwritten
    w.add(200.0, BULK, {"requests": 1})
    assert w.totals(200.0, 60.0)[BULK]["requests"] == 1


def test_windows_bound_their_keys() -> None:
    w = Windows(bucket_s=10.0, span_s=60.0, max_keys=2)
    for i in range(5):
        w.add(0.0, CostKey(f"t{i}", "standard", "p"), {"requests": 1})
    totals = w.totals(0.0, 60.0)
    assert totals[CostKey(OTHER_TENANT, "standard", "p")]["requests"] == 3
    assert len(totals) == 3
    w.forget_idle_keys(100.0)
    w.add(100.0, CostKey("t4", "standard", "p"), {"requests": 1})
    assert CostKey("t4", "standard", "p") in w.totals(100.0, 60.0)


def test_windows_memory_is_bounded_by_the_ring() -> None:
    w = Windows(bucket_s=1.0, span_s=10.0)
    for t in range(1000):
        w.add(float(t), WEB, {"requests": 1})
    assert w.totals(999.0, 10.0)[WEB]["requests"] == 10
    assert len(w._sums) == 10


BLOCK_BYTES = 16 * 131_072


def test_ledger_counts_written_read_and_never_read() -> None:
    ledger = RemoteLedger(capacity_blocks=6, block_bytes=BLOCK_BYTES)
    written, lost = ledger.write([1, 2, 3], WEB)
    assert written == 3 * BLOCK_BYTES and lost == {}
    assert ledger.write([1, 2, 3], WEB)[0] == 0  # held already: nothing new
    assert ledger.read([1, 2]) == 2 * BLOCK_BYTES
    # least recent first: 3, 2, 1 (a prompt's prefix is its most recent block)
    written, lost = ledger.write([10, 11, 12, 13], BULK)  # 7 blocks, capacity 6: block 3 goes
    assert written == 4 * BLOCK_BYTES
    assert set(lost) == {WEB}
    assert lost[WEB].evicted_bytes == BLOCK_BYTES
    assert lost[WEB].never_read_bytes == BLOCK_BYTES  # block 3 was never read
    assert ledger.resident_unread() == {BULK: 4 * BLOCK_BYTES}


def test_ledger_recompute_refreshes_but_is_no_read() -> None:
    ledger = RemoteLedger(capacity_blocks=2, block_bytes=BLOCK_BYTES)
    ledger.write([1], WEB)
    ledger.write([2], WEB)
    assert ledger.read([1], fetched=False) == 0
    _, lost = ledger.write([3], BULK)  # evicts 2 (1 was refreshed), unread
    assert lost[WEB].never_read_bytes == BLOCK_BYTES
    _, lost = ledger.write([4], BULK)  # evicts 1: refreshed, still never read
    assert lost[WEB].never_read_bytes == BLOCK_BYTES


def test_ledger_samples_large_tiers_by_hash() -> None:
    ledger = RemoteLedger(capacity_blocks=10_000, block_bytes=1, max_tracked=1000)
    assert ledger.rate == 10
    written, _ = ledger.write(list(range(5000)), WEB)
    assert written == 5000  # 500 sampled blocks, each standing for 10
    assert len(ledger) == 500
    assert ledger.read(list(range(100))) == 100
