"""The rate of uncached prefill tokens sent to a replica, as the gateway keeps it (`Load`'s
`arrival_tokens_per_s`): gateway/fleet/registry.py at each reservation, and the what-if replay
(routing/whatif/replay.py) with the same bookkeeping, so both route alike.

A request's first token waits for every request its last step holds, and requests sent after it
join that step while it is still to form (routing/prefill_steps.py): the cost model expects this
rate times the time until then. The rate is an exponentially weighted count: each request adds
its tokens, the count decays with time constant `ARRIVALS_TAU_S`, and count / tau is the rate (at
a steady rate r the count settles at r * tau).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import exp

ARRIVALS_TAU_S = 1.0
# ~3.6 full steps of vLLM's default engine (8,192 tokens at ~30k tokens/s plus 3.4 ms:
# routing/cost.py MAX_NUM_BATCHED_TOKENS, PREFILL_TOKENS_PER_S, STEP_S = 277 ms): long enough to
# hold a few requests per replica at a few requests/s, short enough to follow a burst within a
# few steps (the window the cost model applies it to is at most a request's own steps).


@dataclass(slots=True)
class Arrivals:
    """One replica's recent uncached prefill tokens sent, decaying; times on one clock."""

    tokens: float = 0.0  # the decayed count as of `at_s`
    at_s: float = 0.0

    def sent(self, now_s: float, tokens: int) -> None:
        """A request with `tokens` uncached prefill tokens was sent at `now_s`."""
        self.tokens = self.tokens_at(now_s) + tokens
        self.at_s = now_s

    def tokens_at(self, now_s: float) -> float:
        if not self.tokens:
            return 0.0
        elapsed_s = now_s - self.at_s
        return self.tokens * exp(-elapsed_s / ARRIVALS_TAU_S) if elapsed_s > 0.0 else self.tokens

    def per_s(self, now_s: float) -> float:
        """The rate at `now_s`, in tokens per second."""
        return self.tokens_at(now_s) / ARRIVALS_TAU_S
