"""Free loopback ports for throwaway servers (the implementation lives with the Redis launcher)."""

from loadtest.redis_proc import free_port

__all__ = ["free_port"]
