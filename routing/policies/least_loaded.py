"""least_loaded: fewest in-flight requests, then fewest pending prefill tokens, ties by rng. A
baseline."""

from __future__ import annotations

import random
from collections.abc import Sequence

from routing.policies.base import Candidate, Decision, Policy, Reason, RouteRequest, Score


class LeastLoaded:
    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        scores: tuple[Score, ...],
        *,
        seq: int,
        rng: random.Random,
    ) -> Decision:
        keyed = sorted(
            candidates,
            key=lambda c: (c.load.in_flight, c.load.pending_prefill_tokens, rng.random()),
        )
        order = [c.name for c in keyed]
        return Decision(Policy.LEAST_LOADED, order[0], Reason.LEAST_LOADED, tuple(order), scores)
