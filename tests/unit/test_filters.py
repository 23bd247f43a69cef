import random

import pytest

from routing.cost import Load
from routing.decide import Candidate, Policy, PoolRules, RouteRequest, decide
from routing.filters import Eligibility, Fallback, eligible, should_shed
from routing.types import Location, TenantClass, Tier

PINNED = PoolRules("pinned", pinned=True, hbm_only=True, max_in_flight=2, lend_below=0.5)
PINNED_NO_LEND = PoolRules("pinned", pinned=True, hbm_only=True, max_in_flight=2)
SHARED = PoolRules("shared")


def cand(name: str, pool: PoolRules, in_flight: int = 0) -> Candidate:
    return Candidate(name, Load(in_flight), pool=pool)


def names(e: Eligibility) -> list[str]:
    return [c.name for c in e.candidates]


CASES = [
    (
        "critical-goes-pinned",
        [cand("p", PINNED), cand("s", SHARED)],
        TenantClass.CRITICAL,
        Fallback.SPILL,
        True,
        (["p"], ["s"], None),
    ),
    (
        "critical-pinned-full-spills",
        [cand("p", PINNED, 2), cand("s", SHARED)],
        TenantClass.CRITICAL,
        Fallback.SPILL,
        True,
        (["s"], [], Fallback.SPILL),
    ),
    (
        "critical-pinned-full-rejects",
        [cand("p", PINNED, 2), cand("s", SHARED)],
        TenantClass.CRITICAL,
        Fallback.REJECT,
        True,
        ([], [], Fallback.REJECT),
    ),
    (
        "critical-pinned-down-spills",
        [cand("s", SHARED)],
        TenantClass.CRITICAL,
        Fallback.SPILL,
        True,
        (["s"], [], Fallback.SPILL),
    ),
    (
        "critical-no-pinned-pool",
        [cand("s", SHARED)],
        TenantClass.CRITICAL,
        Fallback.REJECT,
        False,
        (["s"], [], None),
    ),
    (
        "standard-never-pinned",
        [cand("p", PINNED_NO_LEND), cand("s", SHARED)],
        TenantClass.STANDARD,
        Fallback.SPILL,
        True,
        (["s"], [], None),
    ),
    (
        "standard-borrows-idle-pinned",
        [cand("p", PINNED), cand("s", SHARED)],
        TenantClass.STANDARD,
        Fallback.SPILL,
        True,
        (["s", "p"], [], None),
    ),
    (
        "standard-not-when-pinned-busy",
        [cand("p", PINNED, 1), cand("s", SHARED)],
        TenantClass.BATCH,
        Fallback.SPILL,
        True,
        (["s"], [], None),
    ),
]


@pytest.mark.parametrize(
    ("candidates", "klass", "fallback", "exists", "expected"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_eligible(
    candidates: list[Candidate],
    klass: TenantClass,
    fallback: Fallback,
    exists: bool,
    expected: tuple[list[str], list[str], Fallback | None],
) -> None:
    e = eligible(candidates, klass, fallback, pinned_pool_exists=exists)
    assert (names(e), [c.name for c in e.overflow], e.fallback) == expected


def test_lending_can_be_turned_off() -> None:
    """While critical traffic spills out of the pinned pool, the planner reclaims it at once."""
    both = [cand("p", PINNED), cand("s", SHARED)]
    assert names(eligible(both, TenantClass.STANDARD, Fallback.SPILL, pinned_pool_exists=True,
                          lend=False)) == ["s"]  # fmt: skip


def test_spilled_critical_counts_cpu_and_remote_hits() -> None:
    """HBM-only is the pinned pool's property: on a shared replica a critical request's CPU-tier
    prefix is worth its swap-in, as for anyone."""
    hits = [frozenset({Location("s", Tier.CPU)})] * 100
    req = RouteRequest(list(range(100)), 1600, 16)
    spilled = eligible([cand("p", PINNED, 2), cand("s", SHARED)], TenantClass.CRITICAL,
                       Fallback.SPILL, pinned_pool_exists=True)  # fmt: skip
    d = decide(req, spilled.candidates, hits, Policy.CACHE_AWARE, seq=0, rng=random.Random(0))
    assert d.replica == "s" and d.score().overlap.cpu_tokens == 1600


def test_hbm_only_pool_ignores_cpu_tier() -> None:
    hits = [frozenset({Location("p", Tier.CPU)})] * 100
    req = RouteRequest(list(range(100)), 1600, 16)
    d = decide(req, [cand("p", PINNED)], hits, Policy.CACHE_AWARE, seq=0, rng=random.Random(0))
    assert d.score().overlap.cpu_tokens == 0 and d.score().estimate.swap_s == 0


@pytest.mark.parametrize(
    ("klass", "pending", "shed"),
    [
        (TenantClass.BATCH, 300_000, True),
        (TenantClass.BATCH, 0, False),
        (TenantClass.STANDARD, 300_000, False),
    ],
    ids=["batch-overloaded", "batch-idle", "standard-never-shed"],
)
def test_should_shed(klass: TenantClass, pending: int, shed: bool) -> None:
    c = Candidate("s", Load(1, pending))
    d = decide(RouteRequest([], 10, 16), [c], [], Policy.CACHE_AWARE, seq=0, rng=random.Random(0))
    assert should_shed(d, klass, max_queue_s=5.0) is shed


def test_cost_placement_offers_every_pinned_and_shared_replica() -> None:
    """critical.placement: cost: a pinned replica over its cap stays a candidate (the estimate,
    which holds its queue, judges it) and the shared replicas are candidates too."""
    both = [cand("p", PINNED, 2), cand("s", SHARED)]
    e = eligible(both, TenantClass.CRITICAL, Fallback.SPILL, pinned_pool_exists=True,
                 cost_placement=True)  # fmt: skip
    assert (names(e), e.overflow, e.fallback) == (["p", "s"], (), None)


def test_cost_placement_follows_the_context_into_the_shared_pool() -> None:
    """A follow-up whose context is in a shared replica's CPU tier goes there, not to an idle
    HBM-only pinned replica that would prefill it all."""
    hits = [frozenset({Location("s", Tier.CPU)})] * 300
    req = RouteRequest(list(range(300)), 4_900, 16)
    e = eligible([cand("p", PINNED), cand("s", SHARED)], TenantClass.CRITICAL, Fallback.SPILL,
                 pinned_pool_exists=True, cost_placement=True)  # fmt: skip
    d = decide(req, e.candidates, hits, Policy.CACHE_AWARE, seq=0, rng=random.Random(0))
    assert d.replica == "s"
    hits = [frozenset({Location("p", Tier.HBM)})] * 300  # and stays on the pinned one if there
    d = decide(req, e.candidates, hits, Policy.CACHE_AWARE, seq=0, rng=random.Random(0))
    assert d.replica == "p"


def test_cost_placement_needs_a_pinned_replica_up() -> None:
    e = eligible([cand("s", SHARED)], TenantClass.CRITICAL, Fallback.SPILL,
                 pinned_pool_exists=True, cost_placement=True)  # fmt: skip
    assert (names(e), e.fallback) == (["s"], Fallback.SPILL)


def test_a_pinned_replica_is_lent_by_its_own_load_alone() -> None:
    """Lending looks at the replica itself (below lend_below of its cap), not at whether the
    others of its pool are busy: each pinned replica is lent or not on its own."""
    idle = Candidate("p1", Load(0, 0), pool=PINNED)
    busy = Candidate("p2", Load(1, 400), pool=PINNED)  # at half its in-flight cap: not lent
    lent = eligible([idle, busy, cand("s", SHARED)], TenantClass.STANDARD, Fallback.SPILL,
                    pinned_pool_exists=True)  # fmt: skip
    assert names(lent) == ["s", "p1"]
