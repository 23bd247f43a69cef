"""Shared fixtures: throwaway real Redis servers on loopback (never the shared one on 6379)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.redis_server import RedisClusterProcs, RedisMissing, RedisServer


def _running(redis: RedisServer | RedisClusterProcs) -> Iterator[str]:
    """Starts `redis`, yields its URL, stops it; fails the test where redis-server is missing."""
    try:
        redis.start()
    except RedisMissing as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield redis.url
    finally:
        redis.stop()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A standalone redis-server for the session; tests isolate themselves by key_prefix."""
    yield from _running(RedisServer())


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A 3-master Redis Cluster for the session; any node's URL bootstraps the client."""
    yield from _running(RedisClusterProcs())
