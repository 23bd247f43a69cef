"""Throwaway real Redis servers for tests; the launcher is shared with loadtest/bench_index.py."""

from loadtest.redis_proc import MISSING_MESSAGE, RedisClusterProcs, RedisMissing, RedisServer

__all__ = ["MISSING_MESSAGE", "RedisClusterProcs", "RedisMissing", "RedisServer"]
