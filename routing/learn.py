"""Learn a replica's costs from the TTFTs the gateway observes. Pure: no IO, no clock.

The cost model (routing/cost.py) is linear in five terms:

    ttft_s = fixed_s
           + prefill_s_per_token * (queued_tokens + uncached_tokens)
           + swap_s_per_token    * swapped_tokens    # CPU-tier tokens x (1 + swap-ins on PCIe)
           + fetch_s_per_token   * fetched_tokens    # remote-tier tokens fetched, not recomputed
           + step_s              * steps             # engine steps until its first token

so every streamed request is one observation of a linear regression. `OnlineFit` solves it over
a sliding window of the last WINDOW observations, weighted by exponential forgetting (the memory
of recursive least squares with forgetting: Ljung & Soderstrom, "Theory and Practice of Recursive
Identification", 1983, ch. 2), by iteratively reweighted least squares with Huber weights, one
reweighting per observation (Holland & Welsch, "Robust regression using iteratively reweighted
least-squares", 1977). Unlike a recursive update, which folds each sample in once with the weight
it got then, the window re-judges every sample against the current fit: the slow first requests
of a fresh engine (warm-up, seen at 3-8x the steady TTFT on vLLM's CPU build) are outliers once
a handful of steady ones have arrived, instead of steering the fit for the next ~50. Made
robust and safe for a router:

- relative errors: each sample is divided by sqrt(observed TTFT x the TTFT its work would take
  at the seed's rates), so a 50 ms and a 5 s request weigh about the same (the fit minimises
  relative error, the figure operators read), an unforeseen delay cannot weigh 100x, and the
  weights do not depend on the fit;
- forgetting the window but its latest SCALE_WINDOW samples when nearly every recent estimate
  missed on the same side (the replica changed): the fit then follows the new replica as fast as
  it learnt the first one, instead of taking the new samples for outliers;
- seeded: parameters are kept relative to a seed (the pool's configured costs or the defaults), so
  the prior is "1.0 x the seed" with a wide spread; terms that are never excited (a pool without
  swaps) stay at their seed instead of drifting;
- Huber weights (Huber, "Robust Estimation of a Location Parameter", 1964) past K_HUBER robust
  scales, once MIN_ROBUST samples are in: a stalled request does not drag the rates;
- a weak prior towards the seed (a ridge term): terms that are not excited stay put, and the
  normal equations are never singular (no "windup" of unexcited directions either);
- bounded parameters: rates stay within [seed / BOUND, seed x BOUND], the overhead within
  [0, MAX_FIXED_S], as a constrained solve (a term at its bound is held there and the others
  are solved again), never negative, never absurd.
"""

from __future__ import annotations

import math
import operator
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from routing.cost import CostTerms

TERMS = ("fixed_s", "prefill_s_per_token", "swap_s_per_token", "fetch_s_per_token", "step_s")
Vector = list[float]
Row = tuple[float, ...]  # one coefficient per term of TERMS

FORGETTING = 0.98
# Memory of ~1 / (1 - 0.98) = 50 observations: converges within the ~50 requests the fit is asked
# to, and follows a replica that slows down within about as many.
WINDOW = 100
# Samples kept: the oldest weighs 0.98^99 = 0.13 of the newest; older ones would weigh less.

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
MIN_ROBUST = 4
# Huber weights from the 4th sample: the median of 4 residuals of a 2-term fit (overhead, prefill)
# ignores one outlier. While the seed is far off every residual is large, so is the scale, and
# nothing is down-weighted. (More reweightings per observation, or Tukey's bisquare, which gives
# far outliers no weight at all, were tried on the synthetic warm-up of tests/unit/test_learn.py:
# no better, and the bisquare was unstable with 20 samples.)

SHIFT_SHARE = 0.85
SHIFT_MIN_RESIDUAL = 0.15
SHIFT_SCALES = 2.0
# A shift: 18 of the last 21 estimates (made before each sample was seen) missed on the same side,
# by a median of more than 15% of the observed TTFT and of more than twice the robust scale of the
# window's residuals. A fit that converges or lags has misses of both signs; a streak of long-tailed
# noise can put 85% of them on one side, but then they are no larger than the usual residual,
# while after a real change they are several times larger.

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
    steps: float = 0.0  # engine steps until its first token (routing/prefill_steps.py)

    def features(self) -> tuple[float, float, float, float, float]:
        return (
            1.0,
            self.queued_tokens + self.uncached_tokens,
            self.swapped_tokens,
            self.fetched_tokens,
            self.steps,
        )


class OnlineFit:
    """One replica's (or one pool's) fitted cost terms; `update()` per observation.

    Parameters are kept relative to the seed (theta = 1: the seed's value), and each sample in
    relative form: its equation divided by the geometric mean of the observed TTFT and what the
    seed predicts for its work, so small and large requests weigh alike, and the weights do not
    depend on the fit itself. The seed alone lets a fully cached request that met an unforeseen
    delay (a queue the gateway did not see, KV that had left HBM) weigh 100x its share and drag
    the overhead to hundreds of ms; the observation alone gives the slow requests that identify
    the swap and fetch rates too little weight to learn them within 50 requests."""

    def __init__(self, seed: CostTerms) -> None:
        self.seed = seed
        self._scale = _seed_vector(seed)  # parameter i = theta[i] * scale[i]
        self._theta: Vector = [1.0] * len(TERMS)
        fixed_var = (FIXED_PRIOR_S / self._scale[0]) ** 2
        rates = len(TERMS) - 1
        self._precision: Vector = [1.0 / fixed_var, *[1.0 / PRIOR_SPREAD**2] * rates]  # the ridge
        self._low: Vector = [0.0, *[1 / RATE_BOUND] * rates]
        self._high: Vector = [MAX_FIXED_S / self._scale[0], *[RATE_BOUND] * rates]
        # the window, oldest first: the rows and targets of the relative equations
        self._rows: deque[Row] = deque(maxlen=WINDOW)
        self._targets: deque[float] = deque(maxlen=WINDOW)
        self._misses: deque[float] = deque(maxlen=SCALE_WINDOW)  # relative, before each update
        self.samples = 0
        self.rejected = 0
        self.resets = 0

    def terms(self) -> CostTerms:
        fixed, prefill, swap, fetch, step = (
            t * s for t, s in zip(self._theta, self._scale, strict=True)
        )
        return CostTerms(fixed, prefill, swap, fetch, step, samples=self.samples)

    def predict_s(self, sample: Sample) -> float:
        return sum(w * x for w, x in zip(self.terms().as_vector(), sample.features(), strict=True))

    def update(self, sample: Sample, *, refit: bool = True) -> bool:
        """Fold one observation in; False (and nothing learned) if it is not a usable TTFT.
        `refit=False` only adds it to the window: the terms change at the next refit (a fit
        nobody reads right now need not be solved after every observation)."""
        y = sample.observed_s
        if not (MIN_OBSERVED_S <= y <= MAX_OBSERVED_S) or any(
            f < 0 or math.isnan(f) for f in sample.features()
        ):
            self.rejected += 1
            return False
        raw = [f * s for f, s in zip(sample.features(), self._scale, strict=True)]
        norm = math.sqrt(y * sum(raw))
        row = tuple(r / norm for r in raw)
        target = y / norm
        self._misses.append(target - _dot(self._theta, row))
        self._rows.append(row)  # the oldest leaves a full window
        self._targets.append(target)
        self.samples += 1
        if self._shifted():
            self._forget_before_shift()
            refit = True
        if refit:
            self._refit()
        return True

    def refit(self) -> None:
        """Solve the window now (after updates with `refit=False`)."""
        if self._rows:
            self._refit()

    def residual_scale(self) -> float:
        """The robust scale of the window's residuals under the current fit (relative units)."""
        if not self._rows:
            return 1.0
        return _robust_scale(_residuals(self._rows, self._targets, self._theta))

    def _refit(self) -> None:
        self._theta = solve_window(
            self._rows, self._targets, self._theta, self._precision, self._low, self._high
        )

    def _shifted(self) -> bool:
        """The replica changed: nearly every recent estimate missed on the same side, by more
        than noise. (A fit that only lags has misses of both signs.)"""
        if len(self._misses) < SCALE_WINDOW:
            return False
        under = sum(1 for m in self._misses if m > 0)
        one_sided = max(under, len(self._misses) - under) >= SHIFT_SHARE * len(self._misses)
        if not one_sided:
            return False
        miss = statistics.median(abs(m) for m in self._misses)
        return miss > max(SHIFT_MIN_RESIDUAL, SHIFT_SCALES * self.residual_scale())

    def _forget_before_shift(self) -> None:
        """Keep only the samples of the last SCALE_WINDOW misses: the fit is then made of the
        replica as it is now (the counterpart of covariance resetting, Goodwin & Sin, "Adaptive
        Filtering Prediction and Control", 1984, sec. 3.3)."""
        keep = min(len(self._misses), len(self._rows))
        while len(self._rows) > keep:
            self._rows.popleft()
            self._targets.popleft()
        self._misses.clear()
        self.resets += 1

    def to_dict(self) -> dict[str, object]:
        """State for sharing between gateways (a Redis hash); `from_dict` is its inverse."""
        return {
            "seed": list(self.seed.as_vector()),
            "theta": list(self._theta),
            "rows": [list(row) for row in self._rows],
            "targets": list(self._targets),
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
            rows = [_floats(row) for row in _list(data["rows"])]
            targets = _floats(data["targets"])
            samples = int(data["samples"])  # type: ignore[call-overload]
        except (KeyError, TypeError, ValueError):
            return fit
        size = len(TERMS)
        if len(theta) != size or len(rows) != len(targets) or any(len(r) != size for r in rows):
            return fit
        if not all(math.isfinite(v) for v in [*theta, *(v for r in rows for v in r), *targets]):
            return fit
        fit._theta = [
            min(max(t, lo), hi) for t, lo, hi in zip(theta, fit._low, fit._high, strict=True)
        ]
        fit._rows.extend(tuple(r) for r in rows[-WINDOW:])
        fit._targets.extend(targets[-WINDOW:])
        fit.samples = max(samples, 0)
        return fit


_AGE_WEIGHTS = [FORGETTING**age for age in range(WINDOW - 1, -1, -1)]  # oldest first


def solve_window(
    rows: Sequence[Row],
    targets: Sequence[float],
    theta: Sequence[float],
    precision: Sequence[float],
    low: Sequence[float],
    high: Sequence[float],
) -> Vector:
    """One reweighting of the window (oldest row first): Huber weights from the residuals of the
    current fit `theta`, forgetting by age, then the weighted, ridge-regularised (towards
    theta = 1 with these precisions), bounded least-squares solve."""
    n = len(rows)
    weights = _AGE_WEIGHTS[WINDOW - n :]
    if n >= MIN_ROBUST:
        residuals = [abs(r) for r in _residuals(rows, targets, theta)]
        limit = K_HUBER * _robust_scale(residuals)
        # Huber: full weight within the limit, limit / |residual| past it
        weights = [
            w if r <= limit else w * limit / r for w, r in zip(weights, residuals, strict=True)
        ]
    # The normal equations: the Gram matrix is symmetric, so only its upper triangle is summed;
    # a refit follows every observation, so this loop is the fit's cost.
    size = len(theta)
    gram = [[0.0] * size for _ in range(size)]
    rhs = [0.0] * size
    for row, y, w in zip(rows, targets, weights, strict=True):
        for i in range(size):
            a = w * row[i]
            if not a:
                continue
            rhs[i] += a * y
            gram_i = gram[i]
            for j in range(i, size):
                gram_i[j] += a * row[j]
    for i in range(size):
        for j in range(i):
            gram[i][j] = gram[j][i]
        gram[i][i] += precision[i]
        rhs[i] += precision[i]  # the prior's mean is theta = 1
    return _bounded_solve(gram, rhs, low, high)


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    # the same products summed in the same order as sum(x * y for ...), so the same float, without
    # a generator frame per product: the window's residuals were most of a refit's CPU
    if len(a) != len(b):
        raise ValueError("vectors of different lengths")
    total: float = sum(map(operator.mul, a, b))
    return total


def _residuals(rows: Sequence[Row], targets: Sequence[float], theta: Sequence[float]) -> Vector:
    return [y - _dot(theta, row) for row, y in zip(rows, targets, strict=True)]


def _robust_scale(residuals: Sequence[float]) -> float:
    median = statistics.median(abs(r) for r in residuals)
    return max(MIN_SCALE, MAD_TO_SIGMA * median)


def _bounded_solve(
    gram: Sequence[Sequence[float]],
    rhs: Sequence[float],
    low: Sequence[float],
    high: Sequence[float],
) -> Vector:
    """argmin of the quadratic with this Gram matrix and right-hand side within [low, high]: solve,
    hold each term that leaves its bounds at the bound, solve the others again (an active set;
    at most one round per term)."""
    size = len(rhs)
    theta = _solve(gram, rhs)
    free = list(range(size))
    while True:
        out = [i for i in free if not low[i] <= theta[i] <= high[i]]
        if not out:
            return theta
        theta = [min(max(t, lo), hi) for t, lo, hi in zip(theta, low, high, strict=True)]
        free = [i for i in free if i not in out]
        if not free:
            return theta
        held = [i for i in range(size) if i not in free]
        b = [rhs[i] - sum(gram[i][j] * theta[j] for j in held) for i in free]
        solved = _solve([[gram[i][j] for j in free] for i in free], b)
        for i, value in zip(free, solved, strict=True):
            theta[i] = value


def _solve(matrix: Sequence[Sequence[float]], rhs: Sequence[float]) -> Vector:
    """x with matrix @ x = rhs: Gaussian elimination with partial pivoting (the method of
    LAPACK's gesv, which numpy.linalg.solve calls; Golub & Van Loan, "Matrix Computations",
    4th ed., alg. 3.4.1). The ridge makes the Gram matrix positive definite, so a zero pivot
    means the inputs were not finite: raised as ArithmeticError rather than returned as NaN."""
    size = len(rhs)
    a = [[*map(float, matrix[i]), float(rhs[i])] for i in range(size)]  # augmented, copied
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(a[r][col]))
        if not a[pivot][col] or not math.isfinite(a[pivot][col]):
            raise ArithmeticError("singular matrix in the cost fit's solve")
        a[col], a[pivot] = a[pivot], a[col]
        head = a[col]
        for r in range(col + 1, size):
            factor = a[r][col] / head[col]
            if factor:
                row = a[r]
                for c in range(col, size + 1):
                    row[c] -= factor * head[c]
    x = [0.0] * size
    for i in range(size - 1, -1, -1):
        x[i] = (a[i][size] - sum(a[i][j] * x[j] for j in range(i + 1, size))) / a[i][i]
    return x


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


def _seed_vector(seed: CostTerms) -> Vector:
    # A zero seed (no fixed overhead configured) would pin its parameter at 0: scale by 1 ms.
    return [v if v > 0 else 0.001 for v in seed.as_vector()]
