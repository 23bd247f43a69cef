"""Throwaway real Redis servers for tests; the launcher is shared with loadtest/bench/index.py."""

from loadtest.bench.redis_servers import (
    MISSING_MESSAGE,
    RedisClusterProcs,
    RedisMissing,
    RedisServer,
)

__all__ = ["MISSING_MESSAGE", "RedisClusterProcs", "RedisMissing", "RedisServer"]
