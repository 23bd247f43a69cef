import pytest

from routing.cost import (
    KV_BYTES_PER_TOKEN,
    PCIE_GBPS,
    PREFILL_TOKENS_PER_S,
    REMOTE_FIXED_S,
    REMOTE_GBPS,
    Load,
    Overlap,
    PoolCosts,
    estimate,
)

COSTS = PoolCosts()


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


def test_running_decodes_interfere_per_prefill_chunk() -> None:
    idle = estimate(Overlap(20_000), Load(), COSTS).queue_s
    busy = estimate(Overlap(20_000), Load(in_flight=100), COSTS).queue_s
    assert idle == 0
    assert busy == pytest.approx(100 * 3 / PREFILL_TOKENS_PER_S)  # 3 chunks of 8192


def test_correction_slows_every_rate() -> None:
    base = estimate(Overlap(3000, cpu_tokens=1000), Load(), COSTS).ttft_s
    assert estimate(Overlap(3000, cpu_tokens=1000), Load(), COSTS, correction=2.0).ttft_s == (
        pytest.approx(2 * base)
    )
