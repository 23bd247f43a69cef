"""How far a decision leans on the cost model: as far as the model has been right on this replica.

The estimate is the product, but only where it is true. Each replica keeps the recent size of
its estimate's miss, `EstimateError`: an exponentially weighted mean of |ln(observed / estimated
TTFT)|, which starts at a prior of a 3x miss (a replica nobody has measured) and earns its way
down as answers arrive. Its `band()` is the share of an estimate that the miss spans.

`doubt_of(band)` says how much a decision leans on a robust cost instead (0: the model alone;
1: the robust cost alone), and `robust_s` is that cost: the tokens the replica would prefill
before this request's first token (its own uncached ones by the index, and those already sent
there and not yet prefilled) at its prefill rate. It is what the peers' cache-aware policies
weigh (a prefix match against the load), in seconds so the two can be blended: it does not
model steps, decodes, loads or the tiers' costs, so it cannot be wrong about them, and between
replicas of one pool a wrong prefill rate scales every candidate alike. A new replica, a changed
engine (its estimates miss until the fit follows it) or a fit gone wrong widen the band and the
robust cost decides more; an estimate that has been right decides alone.

Pure: the gateway feeds `observe` from its answers (gateway/accounting/calibration.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the types only: the policies import this module
    from routing.policies.base import Candidate, Score

PRIOR_LOG_ERROR = math.log(3.0)
# A replica with no answers yet: its estimate may be off by 3x either way. The fleets the family
# benchmark draws differ from the cost model's defaults by up to 15x in prefill rate (2k to 30k
# tokens/s, loadtest/bench/family_members.py); the fit closes most of that within tens of answers
# (routing/learn.py), and the prior's weight falls as (1 - WEIGHT)^n.
WEIGHT = 0.08
# Each answer's weight in the mean: its memory is ~1 / 0.08 = 12 answers, the prior's weight 0.19
# after 20 and 0.04 after 40; short enough to follow a replica that changes as fast as the fit
# forgets (routing/learn.py FORGETTING), long enough that one stalled request moves it by 8%.
MIN_OBSERVED_S = 0.02
# Answers faster than 20 ms are not counted: a few ms of the network and the event loop are a
# large share of them, and no routing choice turns on them.
MAX_LOG_ERROR = math.log(20.0)  # one answer moves the mean by at most WEIGHT x ln 20

TRUSTED_BAND = 0.25
DOUBTED_BAND = 1.0
# The doubt rises from 0 at a typical miss of 25% (the estimate's goal, its p90 within 20-25% on
# the project's estimate benchmark: docs/bench/estimate.md) to 1 at a miss of 2x, linear in
# between: past a 2x miss an estimate cannot rank replicas whose queues differ by less.


@dataclass(slots=True)
class EstimateError:
    """The recent size of a replica's estimate miss (see the module's docstring)."""

    log_error: float = PRIOR_LOG_ERROR
    samples: int = 0

    def observe(self, estimated_s: float, observed_s: float) -> None:
        if observed_s < MIN_OBSERVED_S or estimated_s <= 0:
            return
        miss = min(MAX_LOG_ERROR, abs(math.log(observed_s / estimated_s)))
        self.log_error += WEIGHT * (miss - self.log_error)
        self.samples += 1

    def band(self) -> float:
        """The typical miss as a share of the estimate: exp(mean |ln(observed/estimated)|) - 1."""
        return math.expm1(self.log_error)


def doubt_of(band: float) -> float:
    """How much a decision leans on the robust cost for an estimate whose misses span `band`."""
    return min(1.0, max(0.0, (band - TRUSTED_BAND) / (DOUBTED_BAND - TRUSTED_BAND)))


def robust_s(score: Score, candidate: Candidate) -> float:
    """The prefill ahead of the request's first token on the candidate, in tokens it would
    compute (its own uncached by the index, and the prefills sent there before it) at the
    candidate's prefill rate, plus the fixed cost of a request."""
    terms = candidate.terms
    if terms is None:
        per_token, fixed_s = 1.0 / candidate.costs.prefill_tokens_per_s, candidate.costs.fixed_s
    else:
        per_token, fixed_s = terms.prefill_s_per_token, terms.fixed_s
    own = score.overlap.prompt_tokens - score.expected_cached_tokens
    return fixed_s + per_token * (candidate.load.pending_prefill_tokens + own)
