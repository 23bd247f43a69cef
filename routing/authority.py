"""How far a decision leans on the cost model: as far as the model has been right on this replica.

The estimate is the product, but only where it is true. Each replica keeps the recent size of
its estimate's miss, `EstimateError`: an exponentially weighted mean of |ln(observed / estimated
TTFT)|, which starts at a prior of a 3x miss (a replica nobody has measured) and earns its way
down as answers arrive. `band()` turns it into the margin within which two estimates cannot be
told apart: a typical miss by a factor k makes costs within (k - 1) x the best indistinguishable.

Within that band, the policy (routing/policies/cache_aware.py) orders by a robust rule, the one the
peers' cache-aware policies follow (sglang-router's and vllm-router's cache_aware: the longest
prefix match unless the load is out of balance): most tokens expected cached, a replica whose
in-flight requests exceed the band's least loaded by more than `BALANCE_SLACK` last, then fewer
in flight. A new replica, a changed engine (its estimates miss until the fit follows it) or a
fit gone wrong widen the band, so the robust rule decides more; an estimate that has been right
narrows it to the near-tie of a perfect model.

Pure: the gateway feeds `observe` from its answers (gateway/accounting/calibration.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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

BALANCE_SLACK = 2
# In-flight requests a replica may carry over the band's least loaded before the robust rule
# takes it for out of balance. sglang-router's cache_aware uses an absolute 64 and a ratio of
# 1.5625 (its --balance-abs-threshold / --balance-rel-threshold defaults), sized for fleets of
# large GPUs; on the replicas of a small fleet, 2 requests ahead are already a prefill's wait.


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
        """The share of the best cost within which estimates are taken as equal."""
        return math.expm1(self.log_error)
