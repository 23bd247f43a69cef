"""Routing policies: one module each, on the RoutingPolicy base (base.py), in one registry.

  round_robin   replicas in turn                                       (baseline)
  least_loaded  fewest in-flight requests, then pending prefill tokens (baseline)
  prefix_hash   rendezvous hashing of the prompt's first blocks, bounded load (baseline)
  cache_aware   lowest estimated TTFT from the cost model (the default)

A new policy is one module with a RoutingPolicy subclass that names its `policy` and implements
`rank` (see base.py), its name in `Policy` (base.py: the values `routing.policy` accepts) and one
line in POLICIES below; docs/extending.md walks through it. decide() (routing/decide.py) looks
the configured policy up here.
"""

from __future__ import annotations

from routing.policies.base import Policy, RoutingPolicy
from routing.policies.cache_aware import CacheAware
from routing.policies.least_loaded import LeastLoaded
from routing.policies.prefix_hash import PrefixHash
from routing.policies.round_robin import RoundRobin

__all__ = ["POLICIES", "Policy", "RoutingPolicy"]

POLICIES: dict[Policy, RoutingPolicy] = {
    Policy.ROUND_ROBIN: RoundRobin(),
    Policy.LEAST_LOADED: LeastLoaded(),
    Policy.PREFIX_HASH: PrefixHash(),
    Policy.CACHE_AWARE: CacheAware(),
}
