import pytest

from gateway.serving.relay_time import RelayTime


def test_nothing_seen_is_zero() -> None:
    assert RelayTime().seconds == 0.0


def test_the_median_of_the_recent_window_ignores_a_stall() -> None:
    relay = RelayTime(window=16, every=4)
    for _ in range(15):
        relay.observe(0.001)
    relay.observe(0.5)  # one stall of the event loop
    assert relay.seconds == pytest.approx(0.001)


def test_it_follows_a_change_within_a_window() -> None:
    relay = RelayTime(window=16, every=4)
    for _ in range(16):
        relay.observe(0.001)
    for _ in range(16):
        relay.observe(0.003)
    assert relay.seconds == pytest.approx(0.003)


def test_a_negative_time_is_ignored() -> None:
    relay = RelayTime()
    relay.observe(-0.1)
    assert relay.seconds == 0.0
