"""round_robin: replicas in turn (`seq` is the caller's request counter). A baseline."""

from __future__ import annotations

import random
from collections.abc import Sequence

from routing.policies.base import Candidate, Decision, Policy, Reason, RouteRequest, Score


class RoundRobin:
    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        scores: tuple[Score, ...],
        *,
        seq: int,
        rng: random.Random,
    ) -> Decision:
        start = seq % len(candidates)
        order = [c.name for c in candidates[start:]] + [c.name for c in candidates[:start]]
        return Decision(Policy.ROUND_ROBIN, order[0], Reason.ROUND_ROBIN, tuple(order), scores)
