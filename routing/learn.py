"""Learn a replica's costs from the TTFTs the gateway observes. Pure: no IO, no clock.

The cost model (routing/cost.py) is linear in four terms:

    ttft_s = fixed_s
           + prefill_s_per_token * (queued_tokens + uncached_tokens)
           + swap_s_per_token    * swapped_tokens    # CPU-tier tokens x (1 + swap-ins on PCIe)
           + fetch_s_per_token   * fetched_tokens    # remote-tier tokens fetched, not recomputed

so every streamed request is one observation of a linear regression. `OnlineFit` solves it by
recursive least squares with exponential forgetting (Ljung & Soderstrom, "Theory and Practice of
Recursive Identification", 1983, ch. 2), made robust and safe for a router:

- relative errors: each sample is divided by sqrt(observed TTFT x the TTFT its work would take
  at the seed's rates), so a 50 ms and a 5 s request weigh about the same (the fit minimises
  relative error, the figure operators read), an unforeseen delay cannot weigh 100x, and the
  weights do not depend on the fit;
- covariance resetting when nearly every recent estimate misses on the same side (the replica
  changed): the fit then moves as fast as at its start instead of at its forgetting rate;
- seeded: parameters are kept relative to a seed (the pool's configured costs or the defaults), so
  the prior is "1.0 x the seed" with a wide spread; terms that are never excited (a pool without
  swaps) stay at their seed instead of drifting;
- Huber weights (Huber, "Robust Estimation of a Location Parameter", 1964) past K_HUBER robust
  scales, after a warm-up: one stalled request does not drag the rates;
- bounded covariance: forgetting inflates the covariance of unexcited directions without limit
  ("windup"); each diagonal entry is capped at its prior, keeping the matrix positive definite;
- bounded parameters: rates stay within [seed / BOUND, seed x BOUND], the overhead within
  [0, MAX_FIXED_S]; never negative, never absurd.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from routing.cost import CostTerms

TERMS = ("fixed_s", "prefill_s_per_token", "swap_s_per_token", "fetch_s_per_token")

FORGETTING = 0.98
# Memory of ~1 / (1 - 0.98) = 50 observations: converges within the ~50 requests the fit is asked
# to, and follows a replica that slows down within about as many.

PRIOR_SPREAD = 100.0
# Prior standard deviation, in multiples of the seed: fleets differ from the defaults by 10-100x
# (an H200 vs an L4 vs a CPU build), so the seed is a weak guess that the first samples overrule.

FIXED_PRIOR_S = 0.5
# Prior standard deviation of the fixed overhead, in seconds (the seed is a few ms): a CPU build of
# vLLM spends tens to hundreds of ms per request outside the prefill.

K_HUBER = 1.345
# Residuals past 1.345 robust scales are down-weighted: Huber's constant for 95% efficiency under
# Gaussian noise, and TTFT noise on a shared host is far from Gaussian (long right tail).
SCALE_WINDOW = 21
# The robust scale is 1.4826 x the median |residual| of the last 21 samples (the MAD's normal
# consistency factor): fewer than 11 outliers in 21 cannot move it, while a real shift (a
# replica that slowed down: most residuals large) raises it within ~11 samples, and the fit
# follows drift instead of explaining it away as outliers.
MAD_TO_SIGMA = 1.4826
MIN_SCALE = 0.02  # relative: a 2% spread is the floor of what a TTFT is measured to
WARMUP_SAMPLES = 5
# No down-weighting for the first 5 samples: the scale needs a few residuals. While the seed is
# far off every residual is large, so the scale is too, and nothing is down-weighted anyway.

SHIFT_SHARE = 0.85
SHIFT_MIN_RESIDUAL = 0.15
# A shift: 18 of the last 21 estimates missed on the same side, by a median of more than 15% of
# the observed TTFT. A fit that converges or lags has residuals of both signs; noise alone (even a
# long-tailed one, whose median miss is small) does not put 85% on one side.

RATE_BOUND = 1000.0  # a rate stays within 1/1000x .. 1000x of its seed
MAX_FIXED_S = 30.0  # an overhead above 30 s is a broken replica, not a cost

MIN_OBSERVED_S = 0.001
MAX_OBSERVED_S = 600.0
# Samples outside 1 ms .. 10 min are not TTFTs of a working replica (clock glitch, hung stream).


@dataclass(frozen=True, slots=True)
class Sample:
    """What one request cost on a replica, and the TTFT the gateway then observed."""

    queued_tokens: float  # prefill tokens ahead of it when it was sent
    uncached_tokens: float  # it prefilled
    swapped_tokens: float  # swapped in from the CPU tier, x (1 + swap-ins sharing the link)
    fetched_tokens: float  # fetched from the remote tier
    observed_s: float

    def features(self) -> tuple[float, float, float, float]:
        return (
            1.0,
            self.queued_tokens + self.uncached_tokens,
            self.swapped_tokens,
            self.fetched_tokens,
        )


class OnlineFit:
    """One replica's (or one pool's) fitted cost terms; `update()` per observation."""

    def __init__(self, seed: CostTerms) -> None:
        self.seed = seed
        self._scale = _seed_vector(seed)  # parameter i = theta[i] * scale[i]
        self._theta = [1.0, 1.0, 1.0, 1.0]
        fixed_var = (FIXED_PRIOR_S / self._scale[0]) ** 2
        self._prior = [fixed_var, PRIOR_SPREAD**2, PRIOR_SPREAD**2, PRIOR_SPREAD**2]
        self._p = [[self._prior[i] if i == j else 0.0 for j in range(4)] for i in range(4)]
        self._residuals: deque[float] = deque(maxlen=SCALE_WINDOW)  # |relative residual|
        self._signs: deque[bool] = deque(maxlen=SCALE_WINDOW)  # residual > 0 (underestimate)
        self.samples = 0
        self.rejected = 0
        self.resets = 0

    def terms(self) -> CostTerms:
        t, s = self._theta, self._scale
        return CostTerms(t[0] * s[0], t[1] * s[1], t[2] * s[2], t[3] * s[3], samples=self.samples)

    def predict_s(self, sample: Sample) -> float:
        return sum(w * x for w, x in zip(self.terms().as_vector(), sample.features(), strict=True))

    def update(self, sample: Sample) -> bool:
        """Fold one observation in; False (and nothing learned) if it is not a usable TTFT."""
        y = sample.observed_s
        if not (MIN_OBSERVED_S <= y <= MAX_OBSERVED_S) or any(
            f < 0 or math.isnan(f) for f in sample.features()
        ):
            self.rejected += 1
            return False
        # Relative form: the equation is divided by the geometric mean of the observed TTFT and
        # what the seed predicts (the request's work at the seed's rates), so small and large
        # requests weigh alike, and the weights do not depend on the fit itself. The seed alone
        # lets a fully cached request that met an unforeseen delay (a queue the gateway did not
        # see, KV that had left HBM) weigh 100x its share and drag the fixed overhead to
        # hundreds of ms; the observation alone gives the slow requests that identify the swap
        # and fetch rates too little weight to learn them within 50 requests.
        raw = [f * s for f, s in zip(sample.features(), self._scale, strict=True)]
        predicted = sum(t * r for t, r in zip(self._theta, raw, strict=True))
        norm = math.sqrt(y * sum(raw))
        x = [r / norm for r in raw]
        residual = (y - predicted) / norm
        self._residuals.append(abs(residual))
        self._signs.append(residual > 0)
        weight = 1.0
        limit = K_HUBER * self.residual_scale()
        if self.samples >= WARMUP_SAMPLES and abs(residual) > limit:
            weight = limit / abs(residual)

        p = self._p
        px = [sum(p[i][j] * x[j] for j in range(4)) for i in range(4)]
        denom = FORGETTING / weight + sum(x[i] * px[i] for i in range(4))
        gain = [v / denom for v in px]
        for i in range(4):
            self._theta[i] += gain[i] * residual
            for j in range(4):
                p[i][j] = (p[i][j] - gain[i] * px[j]) / FORGETTING
        self._cap_covariance()
        self._clamp()
        self.samples += 1
        if self._shifted():
            self._reset_covariance()
        return True

    def _shifted(self) -> bool:
        """The replica changed: nearly every recent estimate missed on the same side, by more
        than noise. (A fit that only lags has residuals of both signs.)"""
        if len(self._signs) < SCALE_WINDOW:
            return False
        under = sum(self._signs)
        one_sided = max(under, len(self._signs) - under) >= SHIFT_SHARE * len(self._signs)
        return one_sided and statistics.median(self._residuals) > SHIFT_MIN_RESIDUAL

    def _reset_covariance(self) -> None:
        """Covariance resetting (Goodwin & Sin, "Adaptive Filtering Prediction and Control",
        1984, sec. 3.3): the estimate stays, its uncertainty goes back to the prior, so new
        observations move it as fast as the first ones did."""
        self._p = [[self._prior[i] if i == j else 0.0 for j in range(4)] for i in range(4)]
        self._signs.clear()
        self.resets += 1

    def residual_scale(self) -> float:
        if not self._residuals:
            return 1.0
        return max(MIN_SCALE, MAD_TO_SIGMA * statistics.median(self._residuals))

    def _cap_covariance(self) -> None:
        """Scale row and column i by sqrt(cap / P_ii) where P_ii passed its prior: D P D stays
        symmetric positive definite."""
        p = self._p
        d = [
            math.sqrt(min(1.0, cap / p[i][i])) if p[i][i] > 0 else 1.0
            for i, cap in enumerate(self._prior)
        ]
        if all(v == 1.0 for v in d):
            return
        for i in range(4):
            for j in range(4):
                p[i][j] *= d[i] * d[j]

    def _clamp(self) -> None:
        t = self._theta
        t[0] = min(max(t[0], 0.0), MAX_FIXED_S / self._scale[0])
        for i in range(1, 4):
            t[i] = min(max(t[i], 1 / RATE_BOUND), RATE_BOUND)

    def to_dict(self) -> dict[str, object]:
        """State for sharing between gateways (a Redis hash); `from_dict` is its inverse."""
        return {
            "seed": list(self.seed.as_vector()),
            "theta": list(self._theta),
            "p": [list(row) for row in self._p],
            "residuals": list(self._residuals),
            "samples": self.samples,
        }

    @classmethod
    def from_dict(cls, seed: CostTerms, data: Mapping[str, object]) -> OnlineFit:
        """A fit resumed from `to_dict()` output; a state seeded differently (the config changed)
        or malformed is ignored: the fresh fit is returned."""
        fit = cls(seed)
        try:
            if _floats(data["seed"]) != list(seed.as_vector()):
                return fit
            theta = _floats(data["theta"])
            p = [_floats(row) for row in _list(data["p"])]
            residuals = _floats(data["residuals"])
            samples = int(data["samples"])  # type: ignore[call-overload]
        except (KeyError, TypeError, ValueError):
            return fit
        if len(theta) != 4 or len(p) != 4 or any(len(row) != 4 for row in p):
            return fit
        if not all(math.isfinite(v) for v in [*theta, *(v for row in p for v in row), *residuals]):
            return fit
        fit._theta, fit._p, fit.samples = theta, p, max(samples, 0)
        fit._residuals.extend(abs(v) for v in residuals)
        fit._cap_covariance()
        fit._clamp()
        return fit


def _list(value: object) -> list[object]:
    if not isinstance(value, list):
        raise TypeError("expected a list")
    return value


def _floats(value: object) -> list[float]:
    out = []
    for v in _list(value):
        if not isinstance(v, int | float):
            raise TypeError("expected numbers")
        out.append(float(v))
    return out


def _seed_vector(seed: CostTerms) -> list[float]:
    # A zero seed (no fixed overhead configured) would pin its parameter at 0: scale by 1 ms.
    return [v if v > 0 else 0.001 for v in seed.as_vector()]
