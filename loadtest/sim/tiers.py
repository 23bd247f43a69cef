"""A simulated replica's KV cache tier: the block LRU the what-if replay uses too.

One LRU for both, so the simulator and the planner evict alike; it lives in routing/ because
routing/ may never import loadtest/.
"""

from __future__ import annotations

from routing.whatif.cache import BlockLRU

__all__ = ["BlockLRU"]
