import pytest

from routing.admission import ReuseWindow, family_key, should_write
from routing.cost import PoolCosts

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
