"""A KV tier nobody told the gateway of, found from what the engines report they reused.

A fleet started without a config (`cachelane serve --replicas ...`) may still offload: vLLM's
CPU offloading, or a KV connector to a shared store (LMCache, Mooncake), lets a replica reuse a
prefix its own HBM no longer holds, or never held. The index then expects that prefix to be
computed and the estimate is several times too high (python -m loadtest.bench.family: a 5-replica
fleet with a remote tier the gateway was not told of, estimate p90 miss 4.1 against 0.35 told).

Each answer says how many prompt tokens the engine reused (`usage.prompt_tokens_details.
cached_tokens`). Where the replica's own known prefix was shorter than the longest any replica of
the fleet held (the opportunity), the share of that difference it reused anyway is evidence of a
tier shared by the fleet. `HiddenTier` keeps an exponentially weighted mean of that share per pool;
once it is high over enough opportunities, the pool's replicas read `ANY_HOLDER`, a remote tier
that holds whatever any replica of the fleet was last seen holding (routing/decide.py
overlap_of), loaded at the fit's fetch rate; the gateway neither writes to it nor tells the
engines what to write (it does not know the tier's name or its control). It turns off again if
the engines stop finding those prefixes.

Pure: gateway/accounting/calibration.py feeds it from the answers.
"""

from __future__ import annotations

from dataclasses import dataclass

ANY_HOLDER = "*"
# the remote tier name a pool reads once a hidden tier is inferred (never a configured tier's name:
# gateway/config/pools.py RemoteTierConfig takes letters, digits, '.', '-' and '_')

WEIGHT = 0.1  # each opportunity's weight: the last ~10 decide
MIN_OPPORTUNITY_TOKENS = 32
# Two of vLLM's 16-token blocks: a smaller gap is the rounding of approximate token counts.
MIN_OPPORTUNITIES = 8
# Before 8 answers that could have shown it, nothing is inferred: a replica's HBM the index
# under-counts (its capacity not yet scraped) shows the same surplus for a few requests.
ON_SHARE, OFF_SHARE = 0.5, 0.2
# Inferred once the engines reuse, on the mean, half of what other replicas held; given up below
# a fifth. The gap keeps one odd answer from flipping it back and forth.


@dataclass(slots=True)
class HiddenTier:
    """Evidence, per pool, of a tier that serves prefixes other replicas held."""

    share: float = 0.0
    opportunities: int = 0
    inferred: bool = False

    def observe(self, opportunity_tokens: int, surplus_tokens: int) -> bool:
        """One answer: the replica's known prefix was `opportunity_tokens` shorter than the
        fleet's longest; it reused `surplus_tokens` more than its known prefix. True when that
        turned the inference on or off."""
        if opportunity_tokens < MIN_OPPORTUNITY_TOKENS:
            return False
        was = self.inferred
        found = min(1.0, max(0, surplus_tokens) / opportunity_tokens)
        self.share += WEIGHT * (found - self.share)
        self.opportunities += 1
        if self.opportunities >= MIN_OPPORTUNITIES:
            if self.share >= ON_SHARE:
                self.inferred = True
            elif self.share < OFF_SHARE:
                self.inferred = False
        return self.inferred != was

    @property
    def tier(self) -> str | None:
        """The remote tier name its pool's replicas read for it: ANY_HOLDER once inferred."""
        return ANY_HOLDER if self.inferred else None
