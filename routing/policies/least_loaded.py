"""least_loaded: fewest in-flight requests, then fewest pending prefill tokens, ties by rng. A
baseline."""

from __future__ import annotations

from routing.policies.base import Choice, Policy, Reason, RoutingPolicy


class LeastLoaded(RoutingPolicy):
    policy = Policy.LEAST_LOADED

    def rank(self, choice: Choice) -> tuple[tuple[str, ...], Reason]:
        rand = choice.rng.random
        keyed = sorted(
            choice.candidates,
            key=lambda c: (c.load.in_flight, c.load.pending_prefill_tokens, rand()),
        )
        return tuple(c.name for c in keyed), Reason.LEAST_LOADED
