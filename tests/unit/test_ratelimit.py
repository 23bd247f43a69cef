"""routing/ratelimit.py: GCRA per minute. The Redis script (gateway/tenancy/rate_limits.py) is
checked against the same table in tests/integration/test_rate_limits.py."""

from __future__ import annotations

import pytest

from routing.ratelimit import Verdict, admit, charge

# (tat_s, now_s, cost, per_min) -> Verdict; now_s = 1000 throughout
CASES = [
    pytest.param(0.0, 1000.0, 1, 3, Verdict(True, 1020.0, 0.0), id="empty-bucket-first-request"),
    pytest.param(1040.0, 1000.0, 1, 3, Verdict(True, 1060.0, 0.0), id="third-of-three-fits"),
    pytest.param(1060.0, 1000.0, 1, 3, Verdict(False, 1060.0, 20.0), id="fourth-waits-a-third"),
    pytest.param(1060.0, 1010.0, 1, 3, Verdict(False, 1060.0, 10.0), id="half-way-through-wait"),
    pytest.param(1060.0, 1020.0, 1, 3, Verdict(True, 1080.0, 0.0), id="after-the-wait"),
    pytest.param(0.0, 1000.0, 500, 1000, Verdict(True, 1030.0, 0.0), id="tokens-half-budget"),
    pytest.param(1030.0, 1000.0, 600, 1000, Verdict(False, 1030.0, 6.0), id="tokens-over"),
    pytest.param(0.0, 1000.0, 5000, 1000, Verdict(True, 1060.0, 0.0), id="too-big-full-bucket"),
    pytest.param(1001.0, 1000.0, 5000, 1000, Verdict(False, 1001.0, 1.0), id="too-big-waits-full"),
]


@pytest.mark.parametrize(("tat_s", "now_s", "cost", "per_min", "expected"), CASES)
def test_admit(tat_s: float, now_s: float, cost: float, per_min: float, expected: Verdict) -> None:
    got = admit(tat_s, now_s, cost, per_min)
    assert got.allowed == expected.allowed
    assert got.tat_s == pytest.approx(expected.tat_s)
    assert got.retry_after_s == pytest.approx(expected.retry_after_s)


def test_n_at_once_then_one_per_interval() -> None:
    tat, now = 0.0, 1000.0
    for _ in range(10):
        verdict = admit(tat, now, 1, 10)
        assert verdict.allowed
        tat = verdict.tat_s
    refused = admit(tat, now, 1, 10)
    assert not refused.allowed and refused.retry_after_s == pytest.approx(6.0)
    assert admit(tat, now + 6.0, 1, 10).allowed


@pytest.mark.parametrize(
    ("tat_s", "now_s", "delta", "per_min", "expected"),
    [
        pytest.param(1010.0, 1000.0, 500, 1000, 1040.0, id="more-used-than-estimated"),
        pytest.param(1010.0, 1000.0, 2000, 1000, 1130.0, id="past-the-window"),
        pytest.param(1030.0, 1000.0, -200, 1000, 1018.0, id="less-used"),
        pytest.param(1010.0, 1000.0, -5000, 1000, 1000.0, id="never-before-now"),
        pytest.param(900.0, 1000.0, 100, 1000, 1006.0, id="from-a-full-bucket"),
    ],
)
def test_charge(tat_s: float, now_s: float, delta: float, per_min: float, expected: float) -> None:
    assert charge(tat_s, now_s, delta, per_min) == pytest.approx(expected)
