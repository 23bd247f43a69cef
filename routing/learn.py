"""Learn a replica's costs from the TTFTs the gateway observes. Pure: no IO, no clock.

The cost model (routing/cost.py) is linear in five terms:

    ttft_s = fixed_s
           + prefill_s_per_token * (queued_tokens + uncached_tokens)
           + swap_s_per_token    * swapped_tokens    # CPU-tier tokens x (1 + swap-ins on PCIe)
           + fetch_s_per_token   * fetched_tokens    # remote-tier tokens fetched, not recomputed
           + step_s              * steps             # engine steps until its first token

so every streamed request is one observation of a linear regression, linearised where the
request is: a load (swap-in, fetch) that ended while the request would wait anyway adds nothing
of its own and is counted as the queue it overlapped (`load_under_queue`). `OnlineFit` solves it
over a sliding window of the last WINDOW observations, weighted by exponential forgetting (the
memory of recursive least squares with forgetting: Ljung & Soderstrom, "Theory and Practice of
Recursive Identification", 1983, ch. 2), by iteratively reweighted least squares with Huber
weights, one reweighting per observation (Holland & Welsch, "Robust regression using iteratively
reweighted least-squares", 1977). Unlike a recursive update, which folds each sample in once
with the weight it got then, the window re-judges every sample against the current fit: the slow
first requests of a fresh engine (warm-up, seen at 3-8x the steady TTFT on vLLM's CPU build) are
outliers once a handful of steady ones have arrived, instead of steering the fit for the next
~50. Made robust and safe for a router:

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
- a replica's fit holds each term its observations have excited fewer than MIN_EXCITED times at
  its pool's value (the fit its pool's replicas all feed), and solves the others with it held:
  a swap-in or a remote fetch is a minority of requests, so a replica sees a few of its pool's,
  and learnt from its own few those rates stayed far off for a hundred requests and more (the
  other terms, solved with them, absorbing the error);
- bounded parameters: rates stay within [seed / BOUND, seed x BOUND], the overhead within
  [0, MAX_FIXED_S] and below the window's smallest TTFT (every request pays it), as a
  constrained solve (a term at its bound is held there and the others are solved again), never
  negative, never absurd. The overhead's bound matters: a fit whose window holds many waits it
  cannot explain (later requests filling a step, seen most while a fresh fleet warms up) can
  settle on a large overhead and a low prefill rate, near every request's TTFT but the few
  fastest, which it then takes for outliers: seen at 130-160 ms for ~100 requests on a
  replica whose real overhead was a few ms and whose fastest answers took 23 ms.
"""

from __future__ import annotations

import math
import operator
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, repeat

from routing.cost import CostTerms, Estimate
from routing.normal_equations import (
    Row,  # one coefficient per term of TERMS
    Vector,
    accumulate,
    dot,
    regularised_solve,
    residuals_of,
)

TERMS = ("fixed_s", "prefill_s_per_token", "swap_s_per_token", "fetch_s_per_token", "step_s")

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

MIN_EXCITED = 20
# A replica's term is its own once 20 of its observations excited it; gateway/accounting/
# calibration.py's MIN_OWN_SAMPLES (a replica reads its own fit at all) is the same count.

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


def load_under_queue(estimate: Estimate, step_tokens: int) -> tuple[float, float]:
    """The engine steps, and the prefill tokens computed in them, while the request's KV loads
    (a swap-in, a remote fetch), when it is loaded before the prefill is free for it (it then
    waits, `queue_s` > 0); (0, 0) otherwise. `step_tokens`: a full step's tokens
    (max_num_batched_tokens).

    A load overlaps the queue ahead (routing/cost.py), so when the request still waits once
    loaded, its first token does not depend on how fast its KV loads: the load's time is the
    queue's, and a sample should teach the queue's rates with it, not the load's. Taught as the
    load's, a fetch behind a long queue looks free, and the fit's fetch rate sank to its lower
    bound for the first ~60 requests of a slow tiered fleet (`python -m loadtest.bench.estimate
    --speeds 10`), whose fetches with nothing ahead it then estimated at a third of their time.
    The split keeps the estimate: these steps at the terms in use take `load_s`."""
    queue_steps = estimate.steps - estimate.prefill_steps  # queue_s / a full step's time
    load_s = estimate.load_s
    if estimate.queue_s <= 0.0 or load_s <= 0.0 or queue_steps <= 0.0:
        return 0.0, 0.0
    steps = load_s * queue_steps / estimate.queue_s
    return steps, steps * step_tokens


class OnlineFit:
    """One replica's (or one pool's) fitted cost terms; `update()` per observation.

    Parameters are kept relative to the seed (theta = 1: the seed's value), and each sample in
    relative form: its equation divided by the geometric mean of the observed TTFT and what the
    seed predicts for its work, so small and large requests weigh alike, and the weights do not
    depend on the fit itself. The seed alone lets a fully cached request that met an unforeseen
    delay (a queue the gateway did not see, KV that had left HBM) weigh 100x its share and drag
    the overhead to hundreds of ms; the observation alone gives the slow requests that identify
    the swap and fetch rates too little weight to learn them within 50 requests."""

    def __init__(self, seed: CostTerms, pool: OnlineFit | None = None) -> None:
        self.seed = seed
        self.pool = pool  # its pool's fit, which holds its rarely excited terms (MIN_EXCITED)
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
        # The window's normal equations weighted by age alone, kept as rows come and go (see
        # `_slide`), so a refit does not re-sum the window: a refit follows every batch.
        self._gram: list[Vector] = [[0.0] * len(TERMS) for _ in TERMS]  # upper triangle
        self._rhs: Vector = [0.0] * len(TERMS)
        self._since_exact = 0  # rows slid in since the sums were last summed from the window
        self._misses: deque[float] = deque(maxlen=SCALE_WINDOW)  # relative, before each update
        self.samples = 0
        self.excited = [0] * len(TERMS)  # per term, the samples that excited it (feature > 0)
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
        features = sample.features()
        # not (0 <= f) also holds for NaN
        if not (MIN_OBSERVED_S <= y <= MAX_OBSERVED_S) or not all(map((0.0).__le__, features)):
            self.rejected += 1
            return False
        raw = list(map(operator.mul, features, self._scale))
        norm = math.sqrt(y * sum(raw))
        row = tuple(map(operator.truediv, raw, repeat(norm)))
        target = y / norm
        self._misses.append(target - dot(self._theta, row))
        self._slide(row, target)
        self.samples += 1
        self.excited = [n + (f > 0.0) for n, f in zip(self.excited, features, strict=True)]
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
        return _robust_scale(residuals_of(self._rows, self._targets, self._theta))

    def _slide(self, row: Row, target: float) -> None:
        """Append a row and fold it into the age-weighted sums, O(terms^2): the sums are kept
        relative to the last time they were summed from the window (k rows ago), the new row at
        weight FORGETTING**-k and the one leaving a full window taken out at the weight it came
        in with, so ageing every row is one scalar, FORGETTING**k, applied at the solve. Every
        WINDOW rows the sums are summed again from the window: that keeps the weights within
        1/FORGETTING**WINDOW (7.5), and drops the rounding that the rows which came and went
        leave behind (a row much larger than the rest leaves its rounding on the smaller ones)."""
        old = (self._rows[0], self._targets[0]) if len(self._rows) == WINDOW else None
        self._rows.append(row)  # the oldest leaves a full window
        self._targets.append(target)
        self._since_exact += 1
        k = self._since_exact
        if k >= WINDOW:
            self._sum_window()
            return
        gram, rhs, size = self._gram, self._rhs, len(row)
        w = FORGETTING**-k
        if old is None:
            for i in range(size):
                a = w * row[i]
                if a:
                    rhs[i] += a * target
                    gram_i = gram[i]
                    for j in range(i, size):
                        gram_i[j] += a * row[j]
            return
        # the oldest came in WINDOW rows before this one: out at the weight it came in with
        o_row, o_y = old
        v = -(FORGETTING ** (WINDOW - k))
        for i in range(size):
            a, b = w * row[i], v * o_row[i]
            if a or b:
                rhs[i] += a * target + b * o_y
                gram_i = gram[i]
                for j in range(i, size):
                    gram_i[j] += a * row[j] + b * o_row[j]

    def _sum_window(self) -> None:
        """The age-weighted sums summed from the window itself (see `_slide`)."""
        self._gram, self._rhs = age_weighted_sums(self._rows, self._targets)
        self._since_exact = 0

    def _refit(self) -> None:
        age = FORGETTING**self._since_exact  # every row aged this much since the sums were summed
        self._theta = solve_sums(
            [[age * v for v in g] for g in self._gram],
            [age * v for v in self._rhs],
            self._rows,
            self._targets,
            self._theta,
            self._precision,
            *self._bounds(),
        )

    def _bounds(self) -> tuple[Vector, Vector]:
        """The solve's bounds: the overhead at most the window's smallest TTFT (every request
        pays it), and a term excited fewer than MIN_EXCITED times held at the pool's value."""
        low, high = self._low, list(self._high)
        if self._rows:  # a row's TTFT in units of the overhead's scale: target / row[0] (update)
            smallest = min(map(operator.truediv, self._targets, [row[0] for row in self._rows]))
            high[0] = smallest if smallest < high[0] else high[0]
        pool = self.pool
        if pool is None or pool.seed != self.seed or min(self.excited) >= MIN_EXCITED:
            return low, high
        low = list(low)
        for i, n in enumerate(self.excited):
            if n < MIN_EXCITED:
                low[i] = high[i] = pool._theta[i]
        return low, high

    def _shifted(self) -> bool:
        """The replica changed: nearly every recent estimate missed on the same side, by more
        than noise. (A fit that only lags has misses of both signs.)"""
        if len(self._misses) < SCALE_WINDOW:
            return False
        under = sum(map((0.0).__lt__, self._misses))  # misses above 0
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
        self._sum_window()
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
            "excited": list(self.excited),
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
            # a state without the counts (an older gateway's) excited nothing as far as we know
            excited = [int(n) for n in _floats(data.get("excited", [0.0] * len(TERMS)))]
        except (KeyError, TypeError, ValueError, OverflowError):
            return fit
        size = len(TERMS)
        if len(theta) != size or len(excited) != size or len(rows) != len(targets):
            return fit
        if any(len(r) != size for r in rows):
            return fit
        if not all(math.isfinite(v) for v in [*theta, *(v for r in rows for v in r), *targets]):
            return fit
        fit._theta = [
            min(max(t, lo), hi) for t, lo, hi in zip(theta, fit._low, fit._high, strict=True)
        ]
        fit._rows.extend(tuple(r) for r in rows[-WINDOW:])
        fit._targets.extend(targets[-WINDOW:])
        fit._sum_window()
        fit.samples = max(samples, 0)
        fit.excited = [min(max(n, 0), fit.samples) for n in excited]
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
    theta = 1 with these precisions), bounded least-squares solve. Summed from the window: the
    reference `solve_sums` (what OnlineFit solves) is tested against."""
    weights = _AGE_WEIGHTS[WINDOW - len(rows) :]
    huber = _huber(rows, targets, theta)
    if huber is not None:
        residuals, limit = huber
        # Huber: full weight within the limit, limit / |residual| past it
        weights = [
            w if r <= limit else w * limit / r for w, r in zip(weights, residuals, strict=True)
        ]
    size = len(theta)
    gram = [[0.0] * size for _ in range(size)]
    rhs = [0.0] * size
    accumulate(gram, rhs, rows, targets, weights)
    return regularised_solve(gram, rhs, precision, low, high)


def age_weighted_sums(rows: Sequence[Row], targets: Sequence[float]) -> tuple[list[Vector], Vector]:
    """The window's normal equations (upper triangle of X^T W X, and X^T W y) with W the
    forgetting by age alone."""
    size = len(TERMS)
    gram = [[0.0] * size for _ in range(size)]
    rhs = [0.0] * size
    accumulate(gram, rhs, rows, targets, _AGE_WEIGHTS[WINDOW - len(rows) :])
    return gram, rhs


def solve_sums(
    gram: Sequence[Sequence[float]],
    rhs: Sequence[float],
    rows: Sequence[Row],
    targets: Sequence[float],
    theta: Sequence[float],
    precision: Sequence[float],
    low: Sequence[float],
    high: Sequence[float],
) -> Vector:
    """`solve_window`'s answer from the window's age-weighted sums (`age_weighted_sums`, kept
    by OnlineFit as rows come and go). The Huber weights cannot be kept that way: they re-judge
    every row against the current fit, so a row's weight changes whenever theta does. What a
    refit still reads of every row is its residual (for the robust scale); the sums are then
    corrected only for the rows past the Huber limit, each by the share of its age weight it
    loses: w - w * limit / |residual|."""
    gram_out = [list(g) for g in gram]
    rhs_out = list(rhs)
    huber = _huber(rows, targets, theta)
    if huber is not None:
        residuals, limit = huber
        weights = _AGE_WEIGHTS[WINDOW - len(rows) :]
        out = list(compress(range(len(residuals)), map(limit.__lt__, residuals)))
        cuts = [weights[i] * limit / residuals[i] - weights[i] for i in out]
        accumulate(gram_out, rhs_out, [rows[i] for i in out], [targets[i] for i in out], cuts)
    return regularised_solve(gram_out, rhs_out, precision, low, high)


def _huber(
    rows: Sequence[Row], targets: Sequence[float], theta: Sequence[float]
) -> tuple[Vector, float] | None:
    """The window's |residuals| under `theta` and the Huber limit past which a row is
    down-weighted; None while the window is too small to judge (MIN_ROBUST)."""
    if len(rows) < MIN_ROBUST:
        return None
    residuals = list(map(abs, residuals_of(rows, targets, theta)))
    return residuals, K_HUBER * _robust_scale(residuals)


def _robust_scale(residuals: Sequence[float]) -> float:
    ordered = sorted(map(abs, residuals))  # statistics.median's steps, without a generator
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return max(MIN_SCALE, MAD_TO_SIGMA * median)


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
