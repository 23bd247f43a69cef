import pytest

from routing.admission import ReuseWindow, family_key, should_write
from routing.cost import CostTerms, PoolCosts

COSTS = PoolCosts()


@pytest.mark.parametrize(
    ("prompt", "remote", "shared", "reuse", "write"),
    [
        (8000, 0, 0, 0, False),
        (8000, 0, 8000, 1, True),
        (500, 0, 500, 5, False),
        (2000, 0, 2000, 1, False),
        (2000, 0, 2000, 3, True),
        (8000, 8000, 8000, 10, False),
        (8000, 7000, 8000, 1, True),
        (8000, 0, 200, 50, False),
    ],
    ids=[
        "unique-never",
        "long-reused-once",
        "short-fetch-never-pays",
        "2k-once-not-enough",
        "2k-thrice",
        "already-remote",
        "small-new-tail",
        "one-offs-behind-a-short-header",
    ],
)
def test_should_write(prompt: int, remote: int, shared: int, reuse: float, write: bool) -> None:
    assert should_write(prompt, remote, shared, reuse, COSTS).write is write


def test_a_fleet_slower_than_the_defaults_is_priced_by_its_learned_terms() -> None:
    """A 2k-token prefix seen once does not pay a write at the defaults' prefill rate (an H200,
    30k tokens/s); on replicas whose fit says 10x slower prefill and network, recomputing it costs
    0.67 s against a 0.14 s fetch, so it does."""
    seed = CostTerms.seed(COSTS)
    slow = CostTerms(
        seed.fixed_s,
        seed.prefill_s_per_token * 10,
        seed.swap_s_per_token * 10,
        seed.fetch_s_per_token * 10,
    )
    assert not should_write(2000, 0, 2000, 1, COSTS).write
    assert not should_write(2000, 0, 2000, 1, COSTS, seed).write
    verdict = should_write(2000, 0, 2000, 1, COSTS, slow)
    assert verdict.write
    assert verdict.gain_s == pytest.approx(2000 * slow.prefill_s_per_token - verdict.cost_s)


def test_reuse_window_slides() -> None:
    w = ReuseWindow(window_s=10)
    assert [w.seen(1, t) for t in (0.0, 1.0, 2.0)] == [0, 1, 2]
    assert w.seen(2, 2.0) == 0, "families are counted apart"
    assert w.seen(1, 11.5) == 1, "requests older than the window are forgotten"


def test_reuse_window_is_bounded() -> None:
    w = ReuseWindow(window_s=10, max_families=3)
    for f in range(10):
        w.seen(f, 0.0)
    assert w.seen(0, 0.0) == 0


def test_family_key() -> None:
    assert family_key([]) is None
    assert family_key([1, 2]) == 2
    assert family_key([1, 2, 3, 4, 5, 6]) == 4
