"""routing/pipeline.py and routing/pipeline_writes.py: the routing of one request, pure."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from routing.cost import Estimate, Load, Overlap, PoolCosts, Queued
from routing.decide import Candidate, Policy, PoolRules, Score
from routing.filters import Fallback
from routing.pipeline import (
    LEND_COOLDOWN_S,
    FleetView,
    PipelineRequest,
    PipelineSettings,
    PipelineState,
    Routed,
    Shed,
    Write,
    admit,
    index_writes,
    reclaims_lending,
    route,
)
from routing.types import BlockHits, Location, TenantClass, Tier

BLOCK = 16
COSTS = PoolCosts(prefill_tokens_per_s=10_000.0)  # 1,000 tokens: 100 ms, far past a near tie
SHARED = PoolRules(name="shared")
PINNED = PoolRules(name="pinned", pinned=True, hbm_only=True, max_in_flight=2, lend_below=1.0)
PINNED_TIERED = replace(PINNED, hbm_only=False)  # a pinned pool with a CPU tier
C, S, B = TenantClass.CRITICAL, TenantClass.STANDARD, TenantClass.BATCH
HASHES = list(range(1, 64))  # 63 blocks: ~1,000 tokens
TOKENS = len(HASHES) * BLOCK
SETTINGS = PipelineSettings(Policy.CACHE_AWARE, BLOCK)


def replica(
    name: str, rules: PoolRules = SHARED, *, pending: int = 0, remote_tier: str | None = None
) -> Candidate:
    load = Load(in_flight=1 if pending else 0, pending_prefill_tokens=pending)
    return Candidate(name=name, load=load, costs=COSTS, remote_tier=remote_tier, pool=rules)


def held(where: Location, blocks: int = len(HASHES)) -> BlockHits:
    return [frozenset({where})] * blocks


def shared_hbm(blocks: int) -> BlockHits:
    """The prompt's first `blocks` blocks in shared-0's HBM, the rest nowhere."""
    return held(Location("shared-0", Tier.HBM), blocks) + [frozenset()] * (len(HASHES) - blocks)


def routed(
    klass: TenantClass,
    candidates: list[Candidate],
    hits: BlockHits | None = None,
    settings: PipelineSettings = SETTINGS,
    state: PipelineState | None = None,
    *,
    commit: bool = True,
    tokens: int = TOKENS,
    lend: bool = True,
) -> Routed:
    pinned_pool = any(c.pool.pinned for c in candidates)
    fleet = FleetView(candidates, hits or [], 100.0, pinned_pool_exists=pinned_pool, lend=lend)
    state = state or PipelineState(random.Random(0))
    request = PipelineRequest(HASHES[: -(-tokens // BLOCK)], tokens, klass)
    return route(request, fleet, settings, state, commit=commit)


@pytest.mark.parametrize(
    ("fallback", "decided", "expected"),
    [
        (Fallback.SPILL, "shared-0", Fallback.SPILL),
        (Fallback.REJECT, None, Fallback.REJECT),
    ],
    ids=["spill", "reject"],
)
def test_a_critical_request_with_the_pinned_pool_full_takes_the_fallback(
    fallback: Fallback, decided: str | None, expected: Fallback
) -> None:
    full = [replica(f"pinned-{i}", PINNED, pending=5000) for i in range(2)]
    full = [replace(c, load=replace(c.load, in_flight=2)) for c in full]
    out = routed(C, [*full, replica("shared-0")], settings=replace(SETTINGS, fallback=fallback))
    assert (out.decision.replica if out.decision else None) == decided
    assert out.fallback is expected


@pytest.mark.parametrize(
    ("budget_ms", "where", "fallback"),
    [(None, "pinned-0", None), (1000.0, "pinned-0", None), (50.0, "shared-0", Fallback.SPILL)],
    ids=["no-budget", "within-budget", "over-budget-spills"],
)
def test_pinned_first_spills_a_critical_request_over_its_budget(
    budget_ms: float | None, where: str, fallback: Fallback | None
) -> None:
    busy = replica("pinned-0", PINNED, pending=2000)  # 200 ms queued
    settings = replace(SETTINGS, critical_budget_ms=budget_ms, cost_placement=False)
    out = routed(C, [busy, replica("shared-0")], settings=settings)
    assert out.decision is not None and out.decision.replica == where
    assert out.fallback is fallback


@pytest.mark.parametrize(
    ("pinned_in_flight", "pending", "context_on_shared", "shared_pending", "pressed"),
    [
        (0, 0, True, 0, False),
        (2, 0, True, 0, False),
        (1, 3000, True, 0, False),
        (1, 3000, False, 2500, True),
        (1, 3000, False, 150, False),
    ],
    ids=[
        "idle-context-elsewhere",
        "at-cap-context-elsewhere",
        "busy-context-elsewhere",
        "busy-would-take-it",
        "busy-shared-close",
    ],
)
def test_cost_placement_presses_the_pinned_pool_only_when_short_for_the_request(
    pinned_in_flight: int, pending: int, context_on_shared: bool, shared_pending: int, pressed: bool
) -> None:
    # pressed (the pool reported short) only when a pinned replica without headroom would have
    # taken the request with an empty queue: a cold request (100 ms of prefill) that the shared
    # replica's 250 ms queue makes 3.5x dearer, not a follow-up whose context is on the shared
    # replica, nor one the shared replica serves within the tier preference's margin (15 ms)
    pinned = replica("pinned-0", PINNED, pending=pending)
    pinned = replace(pinned, load=replace(pinned.load, in_flight=pinned_in_flight))
    shared = replica("shared-0", pending=shared_pending)
    hits = held(Location("shared-0", Tier.HBM)) if context_on_shared else None
    out = routed(C, [pinned, shared], hits)
    assert out.decision is not None and out.decision.replica == "shared-0"
    assert out.fallback is Fallback.SPILL
    assert out.pressed is pressed


@pytest.mark.parametrize("engine_priority", [False, True], ids=["fcfs", "priority"])
@pytest.mark.parametrize("cost_placement", [True, False], ids=["cost", "pinned-first"])
def test_a_short_pinned_pool_is_reclaimed_from_lending_only_under_pinned_first(
    engine_priority: bool, cost_placement: bool
) -> None:
    # the pool was short (its busy replica would have taken the cold request idle) either way;
    # cost placement sees the lent work queued on a pinned replica in its estimate, so lending
    # goes on; pinned_first has no estimate of it and stops lending for LEND_COOLDOWN_S
    rules = replace(PINNED, engine_priority=engine_priority)
    pinned = replace(replica("pinned-0", rules, pending=3000), load=Load(2, 3000))  # at its cap
    settings = replace(SETTINGS, cost_placement=cost_placement)
    out = routed(C, [pinned, replica("shared-0", pending=2500)], settings=settings)
    assert out.decision is not None and out.decision.replica == "shared-0"
    assert out.pressed is True
    reclaim_s = 0.0 if cost_placement else LEND_COOLDOWN_S
    assert reclaims_lending(out, C, pinned_pool_exists=True) == reclaim_s


@pytest.mark.parametrize(
    ("shared_holds", "pinned_pending", "where"),
    [(0, 0, "pinned-0"), (8, 0, "pinned-0"), (0, 200, "shared-0"), (32, 0, "shared-0")],
    ids=["idle-tie", "idle-close", "busy-close", "idle-far"],
)
def test_cost_placement_prefers_a_tiered_pinned_replica_with_headroom_at_a_close_cost(
    shared_holds: int, pinned_pending: int, where: str
) -> None:
    # the shared replica holds `shared_holds` of the 63 blocks (8: ~13% cheaper, within 25%;
    # 32: half, not); the pinned one, with a CPU tier, is cold with `pinned_pending` tokens
    # queued (20 ms: close, but a replica with prefill pending has no headroom, so only the best
    # cost takes it)
    pinned = replica("pinned-0", PINNED_TIERED, pending=pinned_pending)
    out = routed(C, [replica("shared-0"), pinned], shared_hbm(shared_holds))
    assert out.decision is not None and out.decision.replica == where
    assert out.decision.ranking[0] == where
    assert out.fallback is (None if where == "pinned-0" else Fallback.SPILL)


@pytest.mark.parametrize(
    ("shared_pending", "where"),
    [(0, "shared-0"), (200, "shared-0"), (3000, "pinned-0")],
    ids=["tie", "close", "far"],
)
def test_critical_cost_placement_keeps_contexts_off_hbm_only_replicas_at_a_close_cost(
    shared_pending: int, where: str
) -> None:
    # both cold; the shared replica (a tier below HBM) has `shared_pending` tokens queued (20 ms:
    # within 25% of the 100 ms prefill; 300 ms: not): an HBM-only pinned replica takes a critical
    # request only when clearly cheaper, since a context built there is found nowhere else
    pinned = replica("pinned-0", PINNED)
    out = routed(C, [replica("shared-0", pending=shared_pending), pinned])
    assert out.decision is not None and out.decision.replica == where
    assert out.fallback is (None if where == "pinned-0" else Fallback.SPILL)
    assert out.pressed is False  # the pinned replica had headroom: lending goes on


@pytest.mark.parametrize("lend", [True, False], ids=["lent", "reclaimed"])
def test_no_lending_while_the_pinned_pool_is_reclaimed(lend: bool) -> None:
    candidates = [replica("pinned-0", PINNED), replica("shared-0", pending=4000)]
    out = routed(S, candidates, lend=lend)
    assert out.decision is not None
    assert out.decision.replica == ("pinned-0" if lend else "shared-0")


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "dry-run"])
def test_clear_while_loading_keeps_lent_requests_off_a_loading_critical_replica(
    commit: bool,
) -> None:
    rules = replace(PINNED, hbm_only=False)
    candidates = [replica("pinned-0", rules), replica("shared-0", pending=400)]
    settings = replace(SETTINGS, clear_while_loading=True, cost_placement=True)
    state = PipelineState(random.Random(0))
    cpu = held(Location("pinned-0", Tier.CPU))  # the critical request swaps its prompt in
    first = routed(C, candidates, cpu, settings, state, commit=commit)
    assert first.decision is not None and first.decision.replica == "pinned-0"
    assert first.decision.score().estimate.load_s > 0
    assert ("pinned-0" in state.critical_joins) is commit
    assert state.seq == (1 if commit else 0)
    lent = routed(S, candidates, settings=settings, state=state, tokens=64)
    assert lent.decision is not None
    assert lent.decision.replica == ("shared-0" if commit else "pinned-0")


@pytest.mark.parametrize(
    ("klass", "queued", "shed"),
    [(B, 100, None), (B, 60_000, Shed.QUEUE), (S, 60_000, None), (C, 60_000, None)],
    ids=["batch-short-queue", "batch-long-queue", "standard-never", "critical-never"],
)
def test_batch_is_shed_when_its_best_queue_is_too_long(
    klass: TenantClass, queued: int, shed: Shed | None
) -> None:
    out = routed(klass, [replica("shared-0", pending=queued)])
    assert out.shed is shed  # 60,000 tokens at 10,000/s: 6 s queued, over the 5 s default


def test_engine_priority_lets_a_critical_request_pass_queued_batch_work() -> None:
    rules = replace(SHARED, engine_priority=True)
    load = Load(in_flight=1, pending_prefill_tokens=5000)
    loaded = replica("shared-0", rules)
    loaded = replace(loaded, load=load)
    critical = routed(C, [loaded]).decision
    batch = routed(B, [loaded]).decision
    assert critical is not None and batch is not None
    assert critical.est_ttft_s <= batch.est_ttft_s


REMOTE = Location("kv", Tier.REMOTE)


@pytest.mark.parametrize(
    ("mode", "reuse", "held_blocks", "write"),
    [
        ("never", 10, 0, False),
        ("always", 0, 0, True),
        ("always", 0, len(HASHES), False),  # nothing new to write
        ("reuse", 0, 0, False),
    ],
    ids=["never", "always", "always-held", "reuse-first-sight"],
)
def test_remote_admission_by_mode(mode: str, reuse: int, held_blocks: int, write: bool) -> None:
    chosen = replica("shared-0", remote_tier="kv")
    settings = replace(SETTINGS, remote_write={"shared": mode})
    verdict = admit(chosen, reuse, held(REMOTE, held_blocks), TOKENS, settings)
    assert verdict is not None and verdict.write is write


def test_no_admission_without_a_remote_tier() -> None:
    assert admit(replica("shared-0"), 5, [], TOKENS, SETTINGS) is None


def score(hbm_blocks: int, cpu_blocks: int = 0, queue_s: float = 0.0) -> Score:
    overlap = Overlap(TOKENS, hbm_blocks * BLOCK, cpu_blocks * BLOCK, 0)
    swap_s = 0.01 if cpu_blocks else 0.0
    return Score("r", overlap, Estimate(0.0, queue_s, swap_s, 0.0, 0.0, False))


HBM = Location("r", Tier.HBM)
CPU = Location("r", Tier.CPU)
P = tuple(HASHES)
Writes = tuple[tuple[Location, tuple[int, ...]], ...]
SWAPPED_IN = ((CPU, P[20:30]), (HBM, P))  # its CPU copies are used, then it is in HBM


@pytest.mark.parametrize(
    ("precise", "stream", "cpu_blocks", "write", "at_send", "at_loaded", "at_first_byte"),
    [
        (False, False, 0, False, (), ((HBM, P),), ()),
        (False, False, 0, True, ((REMOTE, P),), ((HBM, P),), ()),
        (False, True, 0, True, (), ((HBM, P),), ((REMOTE, P),)),
        (False, False, 10, False, (), SWAPPED_IN, ()),
        (False, True, 10, False, (), SWAPPED_IN, ()),
        (False, True, 10, True, (), SWAPPED_IN, ((REMOTE, P),)),
        (True, False, 0, True, ((HBM, P[:20]), (REMOTE, P)), (), ()),
        (True, True, 10, True, ((HBM, P[:20]),), (), ((REMOTE, P),)),
    ],
    ids=[
        "whole",
        "whole-remote",
        "streamed-remote-at-first-byte",
        "whole-swapped",
        "streamed-swapped",
        "streamed-swapped-and-remote",
        "precise-whole",
        "precise-streamed",
    ],
)
def test_the_index_write_plan(
    precise: bool,
    stream: bool,
    cpu_blocks: int,
    write: bool,
    at_send: Writes,
    at_loaded: Writes,
    at_first_byte: Writes,
) -> None:
    settings = replace(SETTINGS, precise=precise)
    writes = index_writes(
        score(20, cpu_blocks),
        HASHES,
        remote_tier="kv",
        write_remote=write,
        stream=stream,
        settings=settings,
    )
    assert writes.at_send == tuple(Write(*w) for w in at_send)
    assert writes.at_loaded == tuple(Write(*w) for w in at_loaded)
    assert writes.at_first_byte == tuple(Write(*w) for w in at_first_byte)
    if precise:
        assert writes.speculative == Write(HBM, P[20:])
    elif cpu_blocks:  # until its swap-in is done, what it does not load is marked
        assert writes.loaded_after_s == pytest.approx(0.01)
        assert writes.speculative == Write(HBM, P[:20] + P[30:])
    else:  # an idle replica schedules it at once
        assert writes.loaded_after_s == 0.0 and writes.speculative is None


@pytest.mark.parametrize("cpu_blocks", [0, 10])
def test_a_queued_request_waits_for_its_load_alone(cpu_blocks: int) -> None:
    """The requests queued ahead of it are recorded already: the engine caches them first."""
    writes = index_writes(
        score(20, cpu_blocks, queue_s=0.2),
        HASHES,
        remote_tier=None,
        write_remote=False,
        stream=True,
        settings=SETTINGS,
    )
    assert writes.loaded_after_s == pytest.approx(0.01 if cpu_blocks else 0.0)
    assert writes.at_loaded == tuple(Write(*w) for w in (SWAPPED_IN if cpu_blocks else ((HBM, P),)))
    assert writes.speculative == (Write(HBM, P[:20] + P[30:]) if cpu_blocks else None)


def with_objective(
    klass: TenantClass,
    candidates: list[Candidate],
    slo_ms: float | None,
    *,
    class_ms: dict[TenantClass, float] | None = None,
    hits: BlockHits | None = None,
) -> Routed:
    fleet = FleetView(candidates, hits or [], 100.0, pinned_pool_exists=False)
    settings = replace(SETTINGS, slo_ms=class_ms or {})
    request = PipelineRequest(HASHES, TOKENS, klass, ttft_slo_ms=slo_ms)
    return route(request, fleet, settings, PipelineState(random.Random(0)), commit=True)


def loading(name: str, rules: PoolRules = SHARED) -> Candidate:
    """A replica where a request still fetching its KV joins the prefill queue in 5 ms: a
    prefill that starts now delays it (Estimate.cuts_in_s)."""
    load = Load(in_flight=1, pending_prefill_tokens=100, queue=(Queued(0.005, 100, -1),))
    return replace(replica(name, rules), load=load)


@pytest.mark.parametrize(
    ("slo_ms", "class_ms", "where", "meets"),
    [
        (None, None, "harmful", None),
        (500.0, None, "harmless", True),
        (None, {S: 500.0}, "harmless", True),
        (5.0, None, "harmful", False),
    ],
    ids=["no-objective", "header", "class-default", "unmeetable-stays"],
)
def test_an_objective_places_where_it_is_met_with_the_least_harm(
    slo_ms: float | None, class_ms: dict[TenantClass, float] | None, where: str, meets: bool | None
) -> None:
    # "harmful" holds most of the prompt (~13 ms) but its prefill would delay a request joining
    # its queue (by ~5 ms); "harmless" is cold (~104 ms) and idle
    harmful = loading("harmful")
    hits = held(Location("harmful", Tier.HBM), len(HASHES) - 6)
    out = with_objective(S, [harmful, replica("harmless")], slo_ms, class_ms=class_ms, hits=hits)
    assert out.decision is not None and out.decision.replica == where
    assert out.meets is meets
    assert out.shed is None


@pytest.mark.parametrize(
    ("pending", "slo_ms", "shed", "retry_after_s"),
    [
        (0, 500.0, None, None),
        (25_000, 500.0, Shed.OBJECTIVE, 3),  # 2.5 s queued at 10,000 tokens/s
        (30_000, 10_000.0, None, None),
    ],
    ids=["met", "missed-shed", "long-objective-met"],
)
def test_batch_is_shed_with_retry_after_when_it_cannot_meet_its_objective(
    pending: int, slo_ms: float, shed: Shed | None, retry_after_s: int | None
) -> None:
    out = with_objective(B, [replica("shared-0", pending=pending)], slo_ms)
    assert out.shed is shed
    assert out.retry_after_s == retry_after_s
    assert out.objective_s == slo_ms / 1000
    assert (out.chosen is None) is (shed is not None)


@pytest.mark.parametrize("klass", [S, C], ids=["standard", "critical"])
def test_only_batch_is_shed_for_its_objective(klass: TenantClass) -> None:
    out = with_objective(klass, [replica("shared-0", pending=30_000)], 500.0)
    assert out.shed is None and out.meets is False
    assert out.decision is not None and out.decision.replica == "shared-0"


def test_batch_is_shed_rather_than_delay_a_request_joining_the_queue() -> None:
    # the only replica meets the batch objective but its prefill would delay a more urgent
    # request still fetching its KV
    out = with_objective(B, [loading("shared-0")], 5_000.0)
    assert out.shed is Shed.OBJECTIVE


@pytest.mark.parametrize(
    ("slo_ms", "where"), [(None, "pinned-0"), (100.0, "shared-0")], ids=["none", "met-by-shared"]
)
def test_the_pinned_preference_yields_to_a_critical_objective(
    slo_ms: float | None, where: str
) -> None:
    # the idle pinned replica (cold, with a CPU tier) is within 25% of the shared one, which
    # holds 8 of the 63 blocks (~107 ms against ~94 ms): preferred, unless only the shared one
    # meets the request's objective (100 ms)
    pinned = replica("pinned-0", PINNED_TIERED)
    hits = shared_hbm(8)
    fleet = FleetView([pinned, replica("shared-0")], hits, 100.0, pinned_pool_exists=True)
    request = PipelineRequest(HASHES, TOKENS, C, ttft_slo_ms=slo_ms)
    out = route(request, fleet, SETTINGS, PipelineState(random.Random(0)), commit=False)
    assert out.decision is not None and out.decision.replica == where
    assert out.fallback is (None if where == "pinned-0" else Fallback.SPILL)
