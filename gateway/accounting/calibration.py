"""Calibration: keep each replica's cost terms true to what the gateway observes.

After every streamed request the gateway knows what the request cost (tokens queued ahead,
prefilled, swapped in, fetched: the decision's estimate, corrected by the engine's own
`usage.prompt_tokens_details.cached_tokens` when the stream carries it) and its time to first
byte. `routing.calibration` says what is done with that:

  fit         routing/learn.py fits each replica's terms online. A replica with fewer than
              MIN_OWN_SAMPLES observations uses its pool's fit (every replica of the pool feeds
              it), so a new replica starts from what its siblings taught. Its own fit then
              holds a term its observations rarely excite at the pool's value
              (routing/learn.py, MIN_EXCITED).
  correction  one multiplicative factor per replica, a moving geometric mean of observed /
              estimated TTFT bounded to CORRECTION_BOUNDS (kept as a baseline).
  none        the pool's configured constants.

Non-streamed responses arrive whole, so their first byte includes the decode; only prefill-only
ones (max_tokens <= 1, such as prewarms) are observations.

A request's observation is queued (`queue`), not learned on the request: the fit's solve is the
costliest step of settling an answer, and the stream's close waited for it. The queue is learned
in one batch LEARN_BATCH_S later (each touched fit solved once), or when something reads the
terms through this class (`describe`, `states`, `terms_of`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from gateway.fleet.replica import Replica
from gateway.telemetry.metrics import Metrics
from routing.authority import doubt_of
from routing.cost import CostTerms
from routing.decide import Score, rescored
from routing.hidden_tier import HiddenTier
from routing.learn import MIN_EXCITED, TERMS, OnlineFit, Sample, load_under_queue
from routing.policies.base import Candidate

log = logging.getLogger("cachelane.calibration")

Mode = Literal["fit", "correction", "none"]

MIN_OWN_SAMPLES = MIN_EXCITED
# Below 20 observations a replica's own fit is still mostly prior; its pool's is not. The same
# count as a term's own (routing/learn.py): below it every term of the own fit is held at the
# pool's anyway.
POOL_REFIT_EVERY = 8
# Once every replica of a pool has its own fit, the pool's is read only by a replica that joins:
# it takes every observation but is solved every 8th (the solve is the fit's costly step,
# routing/learn.py).

LEARN_BATCH_S = 0.1
# A decision uses terms at most 100 ms older than the newest answer; the fit's memory is ~50
# observations (routing/learn.py FORGETTING), so at the ~100 req/s one replica serves in
# docs/bench/overhead.md a batch is a few observations of fifty, and one solve replaces several.
MAX_QUEUED = 64
# A burst that fills the queue before the timer is learned at the loop's next turn: the window
# holds 100 samples (routing/learn.py WINDOW), so a batch never overflows it.

MIN_ESTIMATE_S = 0.005
# correction mode: below 5 ms the observation is dominated by the network round trip and the first
# decode step, which a single factor cannot separate from the prefill.
EWMA_WEIGHT = 0.05  # correction mode: ~the last 20 observations
CORRECTION_BOUNDS = (0.25, 4.0)  # correction mode: a 4x miss was taken for misconfiguration


@dataclass(frozen=True, slots=True)
class Observation:
    replica: Replica
    score: Score  # the decision's view of this replica when the request was sent
    observed_s: float  # time to first byte
    cached_tokens: int | None  # what the engine reported, when the response carried usage
    # the decision's snapshot of the replica and the engine priority the request carried: the
    # score is re-derived from them at the terms in use when it is learned (routing.decide
    # rescored); None: learned from `score` as it is
    candidate: Candidate | None = None
    priority: int | None = None
    # the longest prefix any candidate of the decision held (hbm, cpu, remote), for the evidence
    # of a tier nobody told the gateway of (routing/hidden_tier.py); None: not known
    fleet_cached_tokens: int | None = None


def sample_of(
    score: Score,
    observed_s: float,
    cached_tokens: int | None,
    remote_fixed_s: float = 0.0,
    step_tokens: int = 0,
) -> Sample:
    """The regression sample of one request: the tokens the decision expected in each tier,
    moved to "prefilled" (or from it) by what the engine says it actually reused. A request that
    fetched from the remote tier paid the tier's fixed cost per fetch (`remote_fixed_s`, a
    configured constant the fit does not learn, routing/cost.py): it is taken out of the
    observation, or the fit would spread it over the per-token rates. A load the request waited
    past anyway (it was loaded before the prefill was free for it) is counted as the steps the
    prefill ran meanwhile (routing.learn.load_under_queue, with `step_tokens`, a full step's
    tokens; 0: not at all)."""
    o, e = score.overlap, score.estimate
    fetched = expected_fetch = o.remote_tokens if e.remote_fetch else 0
    uncached = o.prompt_tokens - o.hbm_tokens - o.cpu_tokens - fetched
    swapped = o.cpu_tokens
    if cached_tokens is not None:
        missing = (o.hbm_tokens + swapped + fetched) - cached_tokens
        if missing > 0:  # the engine reused less than expected: the rest was prefilled
            from_fetch = min(missing, fetched)
            from_swap = min(missing - from_fetch, swapped)
            fetched -= from_fetch
            swapped -= from_swap
            uncached += missing
        elif missing < 0:  # it reused more than the estimate counted on
            extra = -missing
            if o.remote_tokens and not e.remote_fetch:
                # the estimate would have recomputed what the remote tier held; the engine
                # loaded it instead (a KV connector loads what it finds): that time is a fetch's
                moved = min(extra, o.remote_tokens)
                fetched += moved
                uncached -= moved
                extra -= moved
            uncached = max(0, uncached - extra)  # the rest: HBM the index did not know of
    # the rest of a decode step under way was measured on the streams, not a cost to learn
    observed_s -= e.step_wait_s
    if step_tokens and swapped == o.cpu_tokens and fetched == expected_fetch:  # loaded as estimated
        steps, tokens = load_under_queue(e, step_tokens)
        if steps:
            return Sample(
                queued_tokens=e.queue_tokens + tokens,
                uncached_tokens=float(uncached),
                swapped_tokens=0.0,
                fetched_tokens=0.0,
                observed_s=observed_s,
                steps=e.steps + steps,
            )
    share = e.swap_tokens / o.cpu_tokens if o.cpu_tokens else 1.0  # 1 + swap-ins sharing PCIe
    return Sample(
        queued_tokens=e.queue_tokens,
        uncached_tokens=float(uncached),
        swapped_tokens=float(swapped * share),
        fetched_tokens=float(fetched),
        observed_s=observed_s - remote_fixed_s if fetched else observed_s,
        steps=e.steps,
    )


class CostLearner:
    """Per-replica cost terms for the decision, learned as `routing.calibration` says."""

    def __init__(self, mode: Mode, replicas: Iterable[Replica], metrics: Metrics) -> None:
        self.mode = mode
        self._metrics = metrics
        self._replicas: dict[str, Replica] = {}
        self._own: dict[str, OnlineFit] = {}
        self._pooled: dict[str, OnlineFit] = {}
        self._hidden: dict[str, HiddenTier] = {}  # by pool: shared by its replicas
        self._queued: list[Observation] = []
        self._learn_soon: asyncio.TimerHandle | asyncio.Handle | None = None
        for r in replicas:
            self.add(r)

    def add(self, r: Replica) -> None:
        """Learn for a replica that joined, or whose pool's costs changed: its own fit, and the
        pool's if it was seeded from other costs, start again from the new seed."""
        self.learn_queued()  # what came before it is learned by the fits it came to
        seed = CostTerms.seed(r.costs)
        self._replicas[r.name] = r
        pooled = self._pooled.get(r.pool.name)
        if pooled is None or pooled.seed != seed:
            pooled = self._pooled[r.pool.name] = OnlineFit(seed)
        else:
            pooled.refit()  # the newcomer reads it: solve what it took since its last refit
        self._own[r.name] = OnlineFit(seed, pool=pooled)
        r.hidden_tier = self._hidden.setdefault(r.pool.name, HiddenTier())
        r.terms = None if self.mode == "none" else self._terms_of(r.name)
        self._export(r)

    def remove(self, name: str) -> None:
        """Forget a replica that left (its pool's fit stays)."""
        self.learn_queued()
        self._replicas.pop(name, None)
        self._own.pop(name, None)

    def queue(self, ob: Observation) -> None:
        """Learn from `ob` off the request: in the next batch (see the module's docstring).
        Without a running event loop (a script, a test) it is learned now."""
        self._queued.append(ob)
        if self._learn_soon is not None and len(self._queued) < MAX_QUEUED:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.learn_queued()
            return
        if self._learn_soon is not None:  # full: learn at the loop's next turn
            self._learn_soon.cancel()
            self._learn_soon = loop.call_soon(self.learn_queued)
        else:
            self._learn_soon = loop.call_later(LEARN_BATCH_S, self.learn_queued)

    def learn_queued(self) -> None:
        """Learn the queued observations now, each touched fit solved once."""
        if self._learn_soon is not None:
            self._learn_soon.cancel()
            self._learn_soon = None
        queued, self._queued = self._queued, []
        if queued:
            self._observe_batch(queued)

    def observe(self, ob: Observation) -> None:
        """Learn from `ob` now (after what is queued, so observations keep their order)."""
        self.learn_queued()
        self._observe_batch([ob])

    def _observe_batch(self, batch: list[Observation]) -> None:
        own_moved: dict[str, Replica] = {}
        pools_moved: set[str] = set()
        for ob in batch:
            replica = ob.replica
            if self._replicas.get(replica.name) is not replica:
                continue  # it left the fleet while this request was finishing
            self._observe_error(ob)
            self._observe_tiers(ob)
            if self.mode == "fit":
                if self._fold(ob):
                    own_moved[replica.name] = replica
                    pools_moved.add(replica.pool.name)
            elif self.mode == "correction":
                self._correct(replica, ob.score.estimate.ttft_s, ob.observed_s)
        for name, replica in own_moved.items():
            self._own[name].refit()
            if not self._pool_fit_in_use(replica.pool.name):  # only its own fit is read
                replica.terms = self._terms_of(name)
                self._export(replica)
        for pool in pools_moved:
            if self._pool_fit_in_use(pool):
                self._pooled[pool].refit()
                self._refresh_pool(pool)

    def _observe_error(self, ob: Observation) -> None:
        est_s, name = ob.score.estimate.ttft_s, ob.replica.name
        error = ob.replica.estimate_error
        error.observe(est_s, ob.observed_s)
        self._metrics.estimate_miss.labels(name).set(error.band())
        self._metrics.estimate_robust_share.labels(name).set(doubt_of(error.band()))
        if ob.observed_s > 0:
            self._metrics.estimate_error.labels(name).observe(
                abs(est_s - ob.observed_s) / ob.observed_s
            )
            self._metrics.estimate_ratio.labels(name).observe(
                ob.observed_s / est_s if est_s > 0 else 0.0
            )

    def _observe_tiers(self, ob: Observation) -> None:
        """Evidence of a hidden tier: what the engine reused beyond the replica's known prefix,
        against what other replicas held. Only where no remote tier is configured."""
        replica = ob.replica
        if ob.cached_tokens is None or ob.fleet_cached_tokens is None:
            return
        if replica.pool.remote_tier or replica.pool.hbm_only:
            return
        o = ob.score.overlap
        known = o.hbm_tokens + o.cpu_tokens
        hidden = replica.hidden_tier
        if hidden.observe(ob.fleet_cached_tokens - known, ob.cached_tokens - known):
            log.info(
                "pool %s: its engines %s prefixes other replicas held: routing %s",
                replica.pool.name,
                "reuse" if hidden.inferred else "no longer reuse",
                "as if they shared a KV tier the config does not name"
                if hidden.inferred
                else "on the configured tiers again",
            )

    def _fold(self, ob: Observation) -> bool:
        """Add `ob` to its replica's and its pool's windows, unsolved; False if not usable.
        The pool's fit, read by nobody once every replica has its own, is solved every
        POOL_REFIT_EVERY samples even then, so a replica that joins finds it near current."""
        replica = ob.replica
        score = ob.score
        if ob.candidate is not None:
            score = rescored(score, ob.candidate, self._terms_of(replica.name), ob.priority)
        costs = replica.costs
        sample = sample_of(
            score,
            ob.observed_s,
            ob.cached_tokens,
            costs.remote_fixed_s,
            costs.engine.max_num_batched_tokens,
        )
        if not self._own[replica.name].update(sample, refit=False):
            return False
        pooled = self._pooled[replica.pool.name]
        pooled.update(sample, refit=pooled.samples % POOL_REFIT_EVERY == 0)
        return True

    def _correct(self, replica: Replica, est_s: float, observed_s: float) -> None:
        if est_s < MIN_ESTIMATE_S or observed_s <= 0:
            return
        low, high = CORRECTION_BOUNDS
        ratio = min(high, max(low, observed_s / est_s))  # est_s already carries the factor
        factor = replica.correction * ratio
        log_c = (1 - EWMA_WEIGHT) * math.log(replica.correction) + EWMA_WEIGHT * math.log(factor)
        replica.correction = min(high, max(low, math.exp(log_c)))
        replica.terms = CostTerms.seed(replica.costs).scaled(replica.correction)
        self._metrics.correction.labels(replica.name).set(replica.correction)
        self._export(replica)

    def _pool_fit_in_use(self, pool: str) -> bool:
        """Does a replica of `pool` still use the pool's fit (too few observations of its own)?"""
        return any(
            r.pool.name == pool and self._own[name].samples < MIN_OWN_SAMPLES
            for name, r in self._replicas.items()
        )

    def _refresh_pool(self, pool: str) -> None:
        for r in self._replicas.values():
            if r.pool.name == pool:
                r.terms = self._terms_of(r.name)
                self._export(r)

    def terms_of(self, replica: str) -> CostTerms:
        """The terms in use for `replica`, with what is queued learned."""
        self.learn_queued()
        return self._terms_of(replica)

    def _terms_of(self, replica: str) -> CostTerms:
        r = self._replicas[replica]
        if self.mode == "none":
            return CostTerms.seed(r.costs)
        if self.mode == "correction":
            return CostTerms.seed(r.costs).scaled(r.correction)
        own = self._own[replica]
        if own.samples >= MIN_OWN_SAMPLES:
            return own.terms()
        pooled = self._pooled[r.pool.name].terms()
        return CostTerms(*pooled.as_vector(), samples=own.samples)

    def _export(self, r: Replica) -> None:
        terms = self._terms_of(r.name)
        for name, value in zip(TERMS, terms.as_vector(), strict=True):
            self._metrics.set_cost_fit(r.name, name, value)
        self._metrics.cost_fit_samples.labels(r.name).set(self._own[r.name].samples)

    def describe(self) -> dict[str, Any]:
        """For /debug/route and route-explain: the terms in use per replica, and their source."""
        self.learn_queued()
        out: dict[str, Any] = {"mode": self.mode, "replicas": {}}
        for name, r in self._replicas.items():
            terms = self._terms_of(name)
            own = self._own[name].samples
            source = {
                "none": "config",
                "correction": "config x correction",
                "fit": self._fit_source(name),
            }[self.mode]
            out["replicas"][name] = {
                "source": source,
                "samples": own,
                "pool_samples": self._pooled[r.pool.name].samples,
                "fixed_ms": round(terms.fixed_s * 1000, 3),
                "prefill_tokens_per_s": round(1 / terms.prefill_s_per_token, 1),
                "swap_tokens_per_s": round(1 / terms.swap_s_per_token, 1),
                "fetch_tokens_per_s": round(1 / terms.fetch_s_per_token, 1),
                "step_ms": round(terms.step_s * 1000, 3),
                # how far its decisions lean on these terms (routing/authority.py)
                "estimate_miss_ratio": round(r.estimate_error.band(), 3),
                "estimate_misses_seen": r.estimate_error.samples,
                "robust_share": round(doubt_of(r.estimate_error.band()), 3),
                # a tier its pool's engines reuse from that the config does not name
                "hidden_tier": r.hidden_tier.inferred,
                "hidden_tier_share": round(r.hidden_tier.share, 3),
            }
        return out

    def _fit_source(self, name: str) -> str:
        """Where a replica's terms come from; the terms its own fit holds at its pool's are
        named where the pool's observations excited them more (not a tier nobody has)."""
        own, pool = self._own[name], self._replicas[name].pool.name
        if own.samples < MIN_OWN_SAMPLES:
            return f"pool {pool!r} fit"
        theirs = self._pooled[pool].excited
        held = [
            term
            for term, n, m in zip(TERMS, own.excited, theirs, strict=True)
            if n < MIN_EXCITED and m > n
        ]
        return f"own fit, {', '.join(held)} at pool {pool!r}'s" if held else "own fit"

    def states(self) -> dict[str, dict[str, object]]:
        """The fits' states, by replica and by pool (key "pool:NAME"), for sharing."""
        self.learn_queued()
        out = {name: fit.to_dict() for name, fit in self._own.items()}
        out |= {f"pool:{name}": fit.to_dict() for name, fit in self._pooled.items()}
        return out

    def resume(self, states: dict[str, dict[str, object]]) -> int:
        """Adopt states another gateway shared (only where they have more samples than ours);
        returns how many fits were adopted."""
        self.learn_queued()
        adopted = 0
        for key, data in states.items():
            pool = key.removeprefix("pool:") if key.startswith("pool:") else None
            table = self._pooled if pool is not None else self._own
            name = pool if pool is not None else key
            mine = table.get(name)
            if mine is None:
                continue
            theirs = OnlineFit.from_dict(mine.seed, data)
            if theirs.samples > mine.samples:
                table[name] = theirs
                adopted += 1
        for name, fit in self._own.items():  # an adopted fit holds terms at its pool's, as now
            fit.pool = self._pooled[self._replicas[name].pool.name]
        if adopted and self.mode == "fit":
            for pool in self._pooled:
                self._refresh_pool(pool)
        return adopted
