"""Integration fixtures: a redis-server of the test's own, for tests that stop or share it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.redis_server import RedisServer


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A throwaway redis-server for this test alone (never the session's, never 6379)."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()
