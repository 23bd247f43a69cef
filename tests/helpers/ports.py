"""Free loopback ports for throwaway servers (implemented in loadtest/bench/processes.py)."""

from loadtest.bench.processes import free_port

__all__ = ["free_port"]
