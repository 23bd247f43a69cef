"""gateway/tenancy/store.py RefreshHealth: failed reads of the tenants are counted every time,
logged at a bounded rate (a clock of the test's own: no timing), and shown in /ready's status."""

from __future__ import annotations

import logging

import pytest
from redis.exceptions import AuthenticationError, TimeoutError

from gateway.tenancy.store import REFRESH_LOG_EVERY_S, RefreshHealth


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_failures_are_counted_each_time_and_logged_once_a_period(
    caplog: pytest.LogCaptureFixture,
) -> None:
    heard: list[str | None] = []
    clock = Clock()
    health = RefreshHealth(loaded=False, on_refresh=heard.append, clock=clock)
    caplog.set_level(logging.WARNING, "cachelane.tenants")
    for _ in range(10):  # ten seconds of a paused Redis
        health.failed(TimeoutError("Timeout reading from socket"), "refresh failed")
        clock.now_s += 1
    assert heard == ["timeout"] * 10
    assert len(caplog.records) == 1
    status = health.status()
    assert (status["loaded"], status["failures"]) == (False, 10)
    assert status["last_error"] == "TimeoutError: Timeout reading from socket"
    clock.now_s += REFRESH_LOG_EVERY_S
    health.failed(AuthenticationError("WRONGPASS"), "refresh failed")
    assert heard[-1] == "auth"
    assert len(caplog.records) == 2
    assert "9 more failure(s) not logged" in caplog.records[-1].getMessage()

    health.succeeded()
    assert heard[-1] is None
    assert health.status() == {"loaded": True, "failures": 0, "last_error": None}
    assert "answers again after 11 failed read(s)" in caplog.records[-1].getMessage()
    health.failed(OSError("refused"), "refresh failed")  # a new run of failures: logged at once
    assert heard[-1] == "connection"
    assert len(caplog.records) == 4


def test_a_read_whose_write_back_failed_counts_as_loaded() -> None:
    heard: list[str | None] = []
    health = RefreshHealth(loaded=False, on_refresh=heard.append, clock=Clock())
    health.read_not_written(OSError("read only"))
    assert health.loaded
    assert heard == [None, "connection"]
