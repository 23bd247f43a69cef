"""The routing of one request: from its candidates to what the index records, and when. Pure.

One pipeline, two callers: the gateway (gateway/serving/planner.py gathers the inputs from its
registry and index, and turns the outcome into HTTP errors, metrics and index writes) and the
what-if replay (routing/whatif/replay.py gathers them from its modelled fleet and applies the
outcome to its modelled engines). Neither decides anything of its own, so a planned routing is the
gateway's routing on the same inputs.

route(), in order:

  1. eligibility by tenant class (routing/filters.py `eligible`): the pinned pools, their
     admission caps and lending (`FleetView.lend`: off while the pinned pool is reclaimed);
     nothing left is a rejection (`Routed.decision` is None, the fallback says which);
  2. decide() with the policy (routing/decide.py), the request carrying its class's engine
     priority (routing/types.py ENGINE_PRIORITY) where a pool schedules by it;
  3. critical, `pinned_first`: when even the best pinned replica's estimate is over the class's
     TTFT budget, decided again over the shared pools too, a shared choice being a spill;
  4. a request with a TTFT objective (its own, or its class's: routing/objectives.py) goes where
     its estimate meets it with the least harm to others;
  5. critical, cost placement (the default): at a cost within CLOSE_COST of the best (and
     meeting the objective if the best does), a replica with a tier below HBM is preferred to
     an HBM-only one, where a context is found nowhere else once evicted, and a pinned one of
     those with headroom (under its admission cap, no prefill pending) to a shared one; a
     shared choice is a spill, and `pressed` says whether the pinned pool was short (a pinned
     replica without headroom would have taken it with an empty queue; lending goes on);
     standard and batch, with `clear_while_loading`: no replica where the request would start
     its prefill ahead of a critical one still loading its KV (decided again without those),
     before step 4;
  6. a batch request is shed (`Routed.shed`, with `retry_after_s`): when no candidate serves it
     within its objective without delaying another request (Shed.OBJECTIVE), or when its best
     replica's prefill queue is longer than `batch_max_queue_s` (Shed.QUEUE, routing/filters.py
     should_shed);
  7. with `commit` (a real request, not /debug/route's dry run) and not shed for its objective:
     a critical request that loads KV first leaves the time it joins its replica's prefill
     queue (`PipelineState.critical_joins`), and the request counter moves on.

Then, for the replica a request is sent to: the remote tier's admission (`admit`, on the reuse
count the caller kept) and the index-write plan (`index_writes`, routing/pipeline_writes.py).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from routing.cost import Load, estimate, seeded
from routing.decide import Candidate, Decision, Policy, RouteRequest, decide
from routing.filters import Eligibility, Fallback, admitted, eligible, should_shed
from routing.objectives import meet, objective_s, shed_retry_after_s
from routing.pipeline_writes import IndexWrites, Write, admit, index_writes
from routing.policies.cache_aware import NEAR_TIE_S, cost_s
from routing.types import ENGINE_PRIORITY, BlockHits, TenantClass

__all__ = [
    "BATCH_MAX_QUEUE_S",
    "LEND_COOLDOWN_S",
    "FleetView",
    "IndexWrites",
    "PipelineRequest",
    "PipelineSettings",
    "PipelineState",
    "Routed",
    "Shed",
    "Write",
    "admit",
    "index_writes",
    "route",
]

BATCH_MAX_QUEUE_S = 5.0  # gateway/config/classes.py OverloadConfig.batch_max_queue_s
LEND_COOLDOWN_S = 5.0
# critical.placement: pinned_first: lending resumes 5 s after the last critical spill: longer
# than a prefill queue takes to drain on a busy replica (~1 s at the standard class's default
# budget, gateway/config/classes.py ClassesConfig), so it does not flap per request. Cost placement
# does not reclaim (_cost_placed says why).
CLOSE_COST = 0.25
# Two preferences of critical cost placement hold while the preferred replica's cost is within 25%
# (at least NEAR_TIE_S) of the best one's: the estimate's own accuracy goal is a p90 error of 25%
# (docs/bench/estimate.md), so a closer estimate is not reliably faster.
# 1. Where the context survives: a replica with no tier below HBM (hbm_only) keeps a critical
#    session's context only in its own HBM, found nowhere else once evicted, so its follow-ups are
#    bound to that one replica's queue; a replica with a CPU tier keeps it longer and writes it to
#    a remote tier every replica of its pool can fetch from. On the benchmark's tiered fleet a
#    pinned HBM-only pool that critical requests preferred took 46-67% of them (8-19% without a
#    pinned pool) and their agent follow-ups recomputed more there (python -m
#    loadtest.bench.critical, `pinned` arm, docs/critical.md).
# 2. Predictability: a pinned replica with a tier below HBM and headroom (it could start the
#    request at once) is preferred to a shared one; a busy one is not, or critical requests queue
#    behind each other at up to 1.25x the best cost, each raising the next one's.


class Shed(StrEnum):
    """Why a request was shed (a metric label)."""

    OBJECTIVE = "objective"  # no candidate serves it within its TTFT objective harmlessly
    QUEUE = "queue"  # its best replica's prefill queue is over overload.batch_max_queue_s


@dataclass(frozen=True, slots=True)
class PipelineSettings:
    """The configuration route() reads (the gateway's config, or a what-if set-up)."""

    policy: Policy
    block_size_tokens: int
    fallback: Fallback = Fallback.SPILL  # critical.fallback
    critical_budget_ms: float | None = None  # classes.critical.ttft_budget_ms
    cost_placement: bool = True  # critical.placement: cost (the default)
    clear_while_loading: bool = False  # critical.clear_while_loading
    batch_max_queue_s: float = BATCH_MAX_QUEUE_S  # overload.batch_max_queue_s
    remote_write: Mapping[str, str] = field(default_factory=dict)  # pool -> reuse/always/never
    precise: bool = False  # routing.mode: precise (the engines' KV events are the index's truth)
    slo_ms: Mapping[TenantClass, float] = field(default_factory=dict)  # classes.*.ttft_slo_ms


@dataclass
class PipelineState:
    """What route() carries from one request to the next: the request counter (round_robin's
    turn), the tie-break generator, and per replica the monotonic time its latest critical
    request joins the prefill queue after loading its KV (critical.clear_while_loading)."""

    rng: random.Random
    seq: int = 0
    critical_joins: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PipelineRequest:
    hashes: Sequence[int]
    prompt_tokens: int
    tenant_class: TenantClass
    policy: Policy | None = None  # None: the configured one (embeddings go by load)
    ttft_slo_ms: float | None = None  # the request's own objective (x-slo-ttft-ms); None: class's


@dataclass(frozen=True, slots=True)
class FleetView:
    """The fleet as the caller sees it now: the healthy replicas serving the model, with their
    loads; the index hits of the prompt; whether the model has a pinned pool at all (down is not
    absent); whether the pinned pools may be lent (not reclaimed by a recent critical spill)."""

    candidates: Sequence[Candidate]
    hits: BlockHits
    now_s: float
    pinned_pool_exists: bool
    lend: bool = True


@dataclass(frozen=True, slots=True)
class Routed:
    """route()'s outcome. `decision` None: rejected (no eligible replica; `eligibility.fallback`
    says whether the pinned pool's `reject` fallback did it)."""

    eligibility: Eligibility
    decision: Decision | None = None
    chosen: Candidate | None = None  # the chosen replica, as it was a candidate
    pressed: bool = True  # a critical request off the pinned pool: did the pool lack headroom?
    reclaim_s: float = LEND_COOLDOWN_S  # if pressed: how long the pinned pool is not lent
    shed: Shed | None = None  # a batch request the fleet is too loaded for, and why
    retry_after_s: int | None = None  # a shed request's Retry-After (Shed.OBJECTIVE's estimate)
    objective_s: float | None = None  # the TTFT objective it was placed for; None: none
    meets: bool | None = None  # with an objective: does the chosen estimate meet it?

    @property
    def fallback(self) -> Fallback | None:
        return self.eligibility.fallback


def route(
    request: PipelineRequest,
    fleet: FleetView,
    settings: PipelineSettings,
    state: PipelineState,
    *,
    commit: bool,
) -> Routed:
    """Route one request (the module docstring lists the steps). `commit`: False for a dry run,
    which leaves the request counter and the critical joins as they were."""
    klass = request.tenant_class
    policy = request.policy or settings.policy
    allowed = eligible(
        fleet.candidates,
        klass,
        settings.fallback,
        pinned_pool_exists=fleet.pinned_pool_exists,
        lend=fleet.lend,
        cost_placement=settings.cost_placement,
    )
    if not allowed.candidates:
        return Routed(allowed)
    route_request = RouteRequest(
        request.hashes, request.prompt_tokens, settings.block_size_tokens, ENGINE_PRIORITY[klass]
    )
    decision = decide(
        route_request, allowed.candidates, fleet.hits, policy, seq=state.seq, rng=state.rng
    )
    objective = objective_s(request.ttft_slo_ms, klass, settings.slo_ms)
    meets = None
    pressed = True
    reclaim = 0.0 if settings.cost_placement else LEND_COOLDOWN_S  # _cost_placed: why not
    if klass is TenantClass.CRITICAL:
        decision, allowed = _spill_over_budget(
            route_request, decision, allowed, fleet, settings, state
        )
        if objective is not None:
            decision, meets = meet(decision, objective, klass)
        if settings.cost_placement:
            decision, allowed, pressed = _cost_placed(decision, allowed, objective)
        allowed = _critical_fallback(decision, allowed, fleet.pinned_pool_exists)
    else:
        decision = _clear_of_loading(route_request, decision, allowed, fleet, state)
        if objective is not None:
            decision, meets = meet(decision, objective, klass)
            retry_after = shed_retry_after_s(decision, klass, meets)
            if retry_after is not None:
                shed = Shed.OBJECTIVE
                return Routed(
                    allowed, decision, None, pressed, reclaim, shed, retry_after, objective, meets
                )
    if commit:
        if klass is TenantClass.CRITICAL and settings.clear_while_loading:
            _remember_join(decision, fleet.now_s, state)
        state.seq += 1
    chosen = next(c for c in (*allowed.candidates, *allowed.overflow) if c.name == decision.replica)
    if should_shed(decision, klass, settings.batch_max_queue_s):
        shed = Shed.QUEUE
        return Routed(allowed, decision, chosen, pressed, reclaim, shed, None, objective, meets)
    return Routed(allowed, decision, chosen, pressed, reclaim, None, None, objective, meets)


def _spill_over_budget(
    request: RouteRequest,
    decision: Decision,
    allowed: Eligibility,
    fleet: FleetView,
    settings: PipelineSettings,
    state: PipelineState,
) -> tuple[Decision, Eligibility]:
    """critical, pinned_first: the pinned pool is too slow for this one (its best estimate is
    over the class's TTFT budget): the shared pools too, with the full cost model."""
    budget = settings.critical_budget_ms
    if not allowed.overflow or budget is None or decision.est_ttft_s * 1000 <= budget:
        return decision, allowed
    wider = decide(
        request,
        allowed.candidates + allowed.overflow,
        fleet.hits,
        decision.policy,
        seq=state.seq,
        rng=state.rng,
    )
    if wider.replica in {c.name for c in allowed.candidates}:
        return decision, allowed
    return wider, replace(allowed, fallback=Fallback.SPILL)


def _cost_placed(
    decision: Decision, allowed: Eligibility, objective: float | None
) -> tuple[Decision, Eligibility, bool]:
    """critical.placement: cost. The cost model chose among pinned and shared replicas; then, at
    a close cost (CLOSE_COST) and meeting the request's objective as well as the chosen one
    does, a replica with a tier below HBM wins over an HBM-only one, and a pinned replica
    with such a tier and headroom over a shared one. A shared choice is a spill (counted as
    one). It says the pinned pool was short for it (`pressed`: the short-share metric and
    /ready's hint) only when a pinned replica without headroom (over its admission cap or with
    prefill pending) would have taken the request with an empty queue. Lending goes on: the
    cost model already sees the lent work queued on a pinned replica and sends the next
    critical request elsewhere when it costs more there, while reclaiming the pool would only
    send standard work to queue on the shared replicas (pinned arm of python -m
    loadtest.bench.critical, seeds 1-3 pooled, overall TTFT p99 against no tenants: 1.14x with
    reclaiming, 0.94x without on the default engine; 1.14x and 1.01x on the fcfs engine;
    docs/critical.md)."""
    candidates = allowed.candidates
    if _chosen(decision, candidates).pool.hbm_only:
        decision = _close(decision, {c.name for c in candidates if not c.pool.hbm_only}, objective)
    if _chosen(decision, candidates).pool.pinned:
        return decision, allowed, False
    pinned = [c for c in candidates if c.pool.pinned]
    if not pinned:
        return decision, replace(allowed, fallback=Fallback.SPILL), True
    tiered = {c.name for c in pinned if not c.pool.hbm_only and _has_headroom(c)}
    placed = _close(decision, tiered, objective)
    if placed is not decision:
        return placed, allowed, False
    chosen = _chosen(decision, candidates)
    pressed = any(_takes_when_idle(decision, c, chosen) for c in pinned)
    return decision, replace(allowed, fallback=Fallback.SPILL), pressed


def _takes_when_idle(decision: Decision, c: Candidate, chosen: Candidate) -> bool:
    """Would this pinned replica without headroom have taken the request, placed as above, had
    its prefill queue been empty? Only then does the critical load press on the pinned pool; a
    follow-up that goes where its context is (a shared replica's CPU or remote tier) does not,
    and counting it would report a pool too small when it is not."""
    if _has_headroom(c):
        return False
    terms = c.terms if c.terms is not None else seeded(c.costs)
    idle_s = estimate(decision.score(c.name).overlap, Load(), c.costs, terms).ttft_s
    chosen_s = cost_s(decision.score())
    if not c.pool.hbm_only:  # preferred within the close margin
        return idle_s <= chosen_s + max(NEAR_TIE_S, CLOSE_COST * chosen_s)
    if chosen.pool.hbm_only:
        return idle_s < chosen_s
    return chosen_s > idle_s + max(NEAR_TIE_S, CLOSE_COST * idle_s)  # beats the tier preference


def _chosen(decision: Decision, candidates: Sequence[Candidate]) -> Candidate:
    return next(c for c in candidates if c.name == decision.replica)


def _has_headroom(c: Candidate) -> bool:
    """Could the replica start a request's prefill at once: under its admission cap (the
    operator's word) with no prefill pending?"""
    return admitted(c) and c.load.pending_prefill_tokens == 0


def _close(decision: Decision, names: set[str], objective: float | None) -> Decision:
    """The decision moved to the replica of least cost among `names` when that cost is within
    CLOSE_COST of the chosen one's and, if the chosen one meets the objective, it does too;
    else the decision as it was."""
    if not names or decision.replica in names:
        return decision
    best = min((s for s in decision.scores if s.replica in names), key=cost_s)
    chosen_s = cost_s(decision.score())
    if cost_s(best) > chosen_s + max(NEAR_TIE_S, CLOSE_COST * chosen_s):
        return decision
    if objective is not None and decision.est_ttft_s <= objective < best.estimate.ttft_s:
        return decision
    ranking = (best.replica, *(n for n in decision.ranking if n != best.replica))
    return replace(decision, replica=best.replica, ranking=ranking)


def _critical_fallback(
    decision: Decision, allowed: Eligibility, pinned_pool_exists: bool
) -> Eligibility:
    """A critical request's fallback as its final place says: a spill when it left an existing
    pinned pool, none when a later step (its objective, the pinned preference) moved it back."""
    chosen = next(c for c in (*allowed.candidates, *allowed.overflow) if c.name == decision.replica)
    if chosen.pool.pinned and allowed.fallback is Fallback.SPILL:
        return replace(allowed, fallback=None)
    if not chosen.pool.pinned and pinned_pool_exists and allowed.fallback is None:
        return replace(allowed, fallback=Fallback.SPILL)
    return allowed


def _clear_of_loading(
    request: RouteRequest,
    decision: Decision,
    allowed: Eligibility,
    fleet: FleetView,
    state: PipelineState,
) -> Decision:
    """critical.clear_while_loading: a non-critical request does not go where it would join the
    prefill queue before a critical request still loading its KV (and so prefill ahead of it,
    as a started prefill is not interrupted). It is decided again without those replicas; if
    none is left, as decided. The joins are recorded only with clear_while_loading on."""
    now_s, joins = fleet.now_s, state.critical_joins
    for name in [r for r, t in joins.items() if t <= now_s]:
        del joins[name]

    def ok(c: Candidate) -> bool:
        return joins.get(c.name, 0.0) <= now_s + decision.score(c.name).estimate.load_s

    chosen = next(c for c in allowed.candidates if c.name == decision.replica)
    if ok(chosen):
        return decision
    kept = [c for c in allowed.candidates if ok(c)]
    if not kept:
        return decision
    return decide(request, kept, fleet.hits, decision.policy, seq=state.seq, rng=state.rng)


def _remember_join(decision: Decision, now_s: float, state: PipelineState) -> None:
    """critical.clear_while_loading: a critical request that loads KV first joins its replica's
    prefill queue only once it is loaded; until then lent requests keep off that replica."""
    est = decision.score().estimate
    if est.load_s > 0:
        join_s = now_s + est.fixed_s + est.load_s
        prior = state.critical_joins.get(decision.replica, 0.0)
        state.critical_joins[decision.replica] = max(prior, join_s)


def reclaims_lending(routed: Routed, klass: TenantClass, pinned_pool_exists: bool) -> float:
    """For how long this routed request reclaims the pinned pools from lending, in seconds (0:
    not at all). A critical request that left the pinned pool because the pool was short for it
    does: for `Routed.reclaim_s`."""
    if klass is not TenantClass.CRITICAL or not pinned_pool_exists or routed.chosen is None:
        return 0.0
    return routed.reclaim_s if not routed.chosen.pool.pinned and routed.pressed else 0.0
