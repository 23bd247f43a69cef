"""A request sent to a replica and awaiting its first byte, as the registry counts it."""

from __future__ import annotations

import math
from typing import NamedTuple


class Joining(NamedTuple):
    """A request sent to a replica and awaiting its first byte."""

    at_s: float  # perf_counter when its KV is loaded (the decision's swap and remote estimate)
    tokens: int  # uncached tokens it prefills
    swaps: bool  # it swaps KV in from the CPU tier
    priority: int | None = None  # the engine priority it was sent with; None: none
    prompt_tokens: int = 0  # its whole prompt: what it computes if its cached prefix is gone
    late_s: float = math.inf  # perf_counter past which it is late (routing.prefill_steps)

    def work(self, now_s: float) -> int:
        """Its uncached tokens; its whole prompt once it is late (routing.prefill_steps
        `late_after_s`): its cached prefix was gone, and the queue behind it waits for all."""
        return self.prompt_tokens if now_s > self.late_s and self.prompt_tokens else self.tokens
