"""round_robin: replicas in turn (`seq` is the caller's request counter). A baseline."""

from __future__ import annotations

from routing.policies.base import Choice, Policy, Reason, RoutingPolicy


class RoundRobin(RoutingPolicy):
    policy = Policy.ROUND_ROBIN

    def rank(self, choice: Choice) -> tuple[tuple[str, ...], Reason]:
        candidates = choice.candidates
        start = choice.seq % len(candidates)
        order = [c.name for c in candidates[start:]] + [c.name for c in candidates[:start]]
        return tuple(order), Reason.ROUND_ROBIN
