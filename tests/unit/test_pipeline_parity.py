"""The gateway and the what-if replay route alike: one pipeline (routing/pipeline.py), two callers.

Each case builds a gateway Planner (real config, Registry, MemoryIndex, ReuseCounter) and the
replay's fleet on the set-up the gateway's capture header describes for that config (so the
replay sees the fleet as `cachelane plan` would). Both get the same requests at one instant (the
gateway's clocks are held still, as the replay's virtual clock is within an arrival: the
registry ages a queue's head by the time that passed) and keep their own load bookkeeping (the
registry's reservations; the fleet's joining requests). After every request: the same decision
(replica, reason, fallback), the same refusal (rejected or shed), the same remote admission and
the same index contents; at the end, the same index once every streamed first byte came.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

import gateway.fleet.registry
import gateway.fleet.replica
import gateway.serving.planner
from gateway.accounting.capture import header
from gateway.config import GatewayConfig, parse_config
from gateway.fleet.registry import Registry
from gateway.http.errors import ApiError
from gateway.index.reuse import ReuseCounter
from gateway.serving.planner import Plan, Planner
from gateway.serving.request_input import PromptHasher, engine_salt
from gateway.telemetry.metrics import Metrics
from gateway.tenancy.tenants import Tenant
from routing.authority import EstimateError
from routing.index import MemoryIndex, record_prompt
from routing.speculative import SpeculativeIndex
from routing.types import Location, TenantClass, Tier
from routing.whatif.capture import CapturedRequest, HitTiers, parse_capture
from routing.whatif.replay import Arrival, Fleet
from routing.whatif.setup import Setup

MODEL = "m"
COSTS = {"prefill_tokens_per_s": 100_000.0}  # slow enough that a cached prefix decides
SLOW = {"prefill_tokens_per_s": 2_000.0}  # a remote write pays back on its first reuse
SYSTEM = "You are a careful assistant. " * 140  # ~1,000 tokens
REPORT = "Summarise the quarterly report for the board in plain words. " * 80  # ~1,000 tokens
SHARED = ["http://replica-a:8000", "http://replica-b:8000", "http://replica-c:8000"]
PINNED = ["http://pinned-a:8000", "http://pinned-b:8000"]
GROUP = "team"  # every tenant shares one cache scope, so prefixes cross classes
TENANTS = {k: Tenant(k.value, k, GROUP) for k in TenantClass}
C, S, B = TenantClass.CRITICAL, TenantClass.STANDARD, TenantClass.BATCH


def pool(name: str, urls: list[str], **extra: Any) -> dict[str, Any]:
    return {"name": name, "replicas": urls, "models": [MODEL], "costs": COSTS, **extra}


def shared(**extra: Any) -> dict[str, Any]:
    return pool("shared", SHARED, **extra)


def pinned(**extra: Any) -> dict[str, Any]:
    rules = {"pinned": True, "hbm_only": True, "admission": {"max_in_flight": 1}}
    return pool("pinned", PINNED, **{**rules, **extra})


def pinned_tiered(**extra: Any) -> dict[str, Any]:
    """A pinned pool with a CPU tier: critical cost placement prefers it at a close cost."""
    return pinned(hbm_only=False, cpu_capacity_tokens=100_000, **extra)


def prompt(user: str, repeat: int = 1) -> str:
    return SYSTEM + (user + " ") * repeat


@dataclass(frozen=True)
class Seeded:
    """Blocks of a prompt the index holds before the first request."""

    text: str
    where: Location
    blocks: int | None = None  # leading blocks; None: all


@dataclass(frozen=True)
class Case:
    pools: tuple[dict[str, Any], ...]
    steps: tuple[tuple[TenantClass, str], ...]
    overrides: dict[str, Any] = field(default_factory=dict)
    seeded: tuple[Seeded, ...] = ()
    expect: frozenset[str] = frozenset()  # what the gateway must do somewhere in the case


REMOTE = {"remote_tiers": [{"name": "kv", "url": "http://kv:9100"}]}
BUDGET = {"classes": {"critical": {"ttft_budget_ms": 1.0}}}  # every pinned estimate is over it
CPU_A = Location("replica-a:8000", Tier.CPU)
CPU_PINNED = Location("pinned-a:8000", Tier.CPU)
HELD = Location("kv", Tier.REMOTE)

CASES = {
    "shared-classes": Case(
        (shared(),),
        ((S, prompt("a")), (S, prompt("a")), (B, prompt("b")), (C, prompt("a", 3)), (S, "x")),
        expect=frozenset({"hbm_hit", "critical@replica", "batch@replica"}),
    ),
    "pinned-first": Case(
        (pinned(lend_below=None), shared()),
        ((C, prompt("a")), (C, prompt("a")), (C, prompt("b")), (C, prompt("c")), (S, prompt("a"))),
        {"critical": {"placement": "pinned_first"}},
        expect=frozenset({"critical@pinned", "spill"}),
    ),
    "pinned-first-over-budget": Case(
        (pinned(lend_below=None), shared()),
        ((S, prompt("a")), (C, prompt("a")), (C, prompt("b")), (S, prompt("c"))),
        {**BUDGET, "critical": {"placement": "pinned_first"}},
        expect=frozenset({"spill", "critical@replica"}),
    ),
    "pinned-default-knobs": Case(  # nothing but `pinned: true`: cost placement, lending
        (pool("pinned", PINNED, pinned=True), pool("shared", SHARED[:1], costs=SLOW)),
        ((S, prompt("b")), (C, prompt("a")), (C, prompt("a")), (C, prompt("c")), (S, "short")),
        expect=frozenset({"critical@pinned", "standard@pinned"}),
    ),
    "class-objectives": Case(
        (pool("shared", SHARED[:1]),),
        ((S, prompt("a")), (S, prompt("b")), (B, prompt("c")), (C, prompt("d")), (B, "tiny")),
        {"classes": {"batch": {"ttft_slo_ms": 5.0}, "critical": {"ttft_slo_ms": 50.0}}},
        expect=frozenset({"shed", "critical@replica"}),
    ),
    "pinned-reject": Case(
        (pinned(), shared()),
        ((C, prompt("a")), (C, prompt("b")), (C, prompt("c")), (S, prompt("d"))),
        {"critical": {"fallback": "reject"}},
        expect=frozenset({"reject", "rejected"}),
    ),
    "cost-placement": Case(
        (pinned_tiered(), shared()),
        ((S, prompt("a")), (C, prompt("a")), (C, prompt("b")), (C, prompt("c")), (C, prompt("a"))),
        {"critical": {"placement": "cost"}},
        expect=frozenset({"critical@pinned", "spill"}),
    ),
    "cost-placement-hbm-only": Case(
        (pinned(), shared()),
        ((C, prompt("a")), (C, prompt("b")), (S, "short"), (C, prompt("a"))),
        {"critical": {"placement": "cost"}},
        # at a close cost a critical request goes where its context survives, off the HBM-only
        # pinned pool
        expect=frozenset({"critical@replica", "spill"}),
    ),
    "lending": Case(
        (
            pinned(lend_below=1.0, admission={"max_in_flight": 4}),
            pool("shared", SHARED[:1]),
        ),
        ((S, prompt("a")), (S, "short"), (B, "tiny"), (S, prompt("b")), (S, "brief")),
        expect=frozenset({"standard@pinned", "batch@pinned", "standard@replica"}),
    ),
    "lending-reclaimed": Case(
        (pinned_tiered(lend_below=1.0), pool("shared", SHARED[:1])),
        ((C, prompt("a")), (C, prompt("b")), (C, prompt("c")), (S, "short"), (B, "tiny")),
        {"critical": {"placement": "pinned_first"}},  # cost placement does not reclaim
        # the third critical request spills (both pinned replicas at their cap), which reclaims
        # the pinned pool: both sides keep the standard and batch requests on the shared one
        expect=frozenset({"spill", "critical@pinned", "standard@replica", "batch@replica"}),
    ),
    "clear-while-loading": Case(
        (
            pinned(
                hbm_only=False,
                cpu_capacity_tokens=100_000,
                lend_below=1.0,
                admission={"max_in_flight": 4},
            ),
            pool("shared", SHARED[:1]),
        ),
        ((S, prompt("q")), (C, prompt("a")), (S, "short"), (S, "brief")),
        {"critical": {"placement": "cost", "clear_while_loading": True}},
        (Seeded(prompt("a"), CPU_PINNED),),
        expect=frozenset({"cpu_hit", "critical@pinned", "standard@pinned"}),
    ),
    "shedding": Case(
        (pool("shared", SHARED[:1]),),
        ((S, prompt("a")), (S, prompt("b")), (B, prompt("c")), (B, "tiny")),
        {"overload": {"batch_max_queue_s": 0.005}},
        expect=frozenset({"shed"}),
    ),
    "remote-reuse": Case(
        (shared(cpu_capacity_tokens=100_000, remote_tier="kv", costs=SLOW),),
        (*((S, REPORT + x) for x in "abcab"), (B, prompt("b")), (S, prompt("a"))),
        REMOTE,
        (Seeded(prompt("a"), CPU_A, 20), Seeded(prompt("b"), HELD)),
        expect=frozenset({"remote_hit", "remote_write"}),
    ),
    "remote-always": Case(
        (shared(remote_tier="kv", remote_write="always"),),
        ((S, prompt("a")), (S, prompt("b")), (S, prompt("a"))),
        REMOTE,
        (Seeded(prompt("b"), HELD, 30),),
        expect=frozenset({"remote_write"}),
    ),
    "engine-priority": Case(
        (pinned_tiered(engine_priority=True), shared(engine_priority=True)),
        ((B, prompt("a")), (S, prompt("b")), (C, prompt("c")), (C, prompt("a")), (B, prompt("b"))),
        expect=frozenset({"critical@pinned", "batch@replica"}),
    ),
}


@dataclass(frozen=True)
class Routed:
    """One request's routing as either side reports it."""

    replica: str | None
    reason: str | None
    fallback: str | None
    refused: str | None  # "rejected" or "shed"
    remote_write: bool


class StillTimer:
    def cancel(self) -> None:
        pass


def still_timer(*_: object) -> StillTimer:
    """The gateway's timers at one instant: none fires (the index writes planned for a
    end of a request's KV load wait for its first byte, as in the replay, whose events do not
    run within arrivals)."""
    return StillTimer()


class Gateway:
    def __init__(self, cfg: GatewayConfig) -> None:
        metrics = Metrics()
        self.registry = Registry(cfg)
        self.index = SpeculativeIndex(MemoryIndex())  # what routing reads, as gateway/wiring.py
        reuse = ReuseCounter(metrics)
        self.planner = Planner(
            cfg, self.registry, self.index, reuse, metrics, self.index, call_later=still_timer
        )
        self.hasher = PromptHasher(cfg, self.registry, metrics, {})
        self.sent: list[Plan] = []

    async def route(self, tenant: Tenant, text: str, stream: bool) -> Routed:
        body = {"model": MODEL, "prompt": text, "stream": stream}
        try:
            plan = await self.planner.plan("completions", body, tenant)
        except ApiError as err:
            refused = "shed" if err.code == "overloaded" else "rejected"
            return Routed(None, None, _fallback_of(err), refused, False)
        replica = self.registry.replicas[plan.decision.replica]
        score = plan.decision.score()
        self.registry.reserve(  # as gateway/serving/proxy.py _reserve does
            replica,
            prefill_tokens=score.overlap.prompt_tokens - score.expected_cached_tokens,
            swaps=1 if score.overlap.cpu_tokens else 0,
            load_s=score.estimate.load_s,
            priority=plan.engine_priority(replica),
        )
        await self.planner.record_sent(plan, replica)
        self.sent.append(plan)
        d = plan.decision
        write = plan.admission is not None and plan.admission.write
        fallback = plan.fallback.value if plan.fallback else None
        return Routed(d.replica, d.reason.value, fallback, None, write)

    async def first_bytes(self) -> None:
        for plan in self.sent:
            await self.planner.record_loaded(plan, self.registry.replicas[plan.decision.replica])


def _fallback_of(err: ApiError) -> str | None:
    return "reject" if err.code == "pinned_pool_unavailable" else None


def replay_fleet(gw: Gateway, cfg: GatewayConfig) -> Fleet:
    capture = parse_capture([header(cfg, gw.registry)])
    return Fleet(Setup.from_capture(capture), seed=cfg.routing.seed)


def replayed(arrival: Arrival) -> Routed:
    r = arrival.routed
    fallback = r.fallback.value if r.fallback else None
    if r.decision is None or r.shed:
        return Routed(None, None, fallback, "shed" if r.shed else "rejected", False)
    d = r.decision
    return Routed(d.replica, d.reason.value, fallback, None, arrival.write)


def captured(
    tenant: Tenant, hashes: list[int], prompt_tokens: int, stream: bool
) -> CapturedRequest:
    return CapturedRequest(
        t_s=0.0,
        tenant=tenant.name,
        tenant_class=tenant.tenant_class.value,
        model=MODEL,
        pool="",
        replica="",
        prompt_tokens=prompt_tokens,
        hashes=tuple(hashes),
        stream=stream,
        ttft_s=None,
        e2e_s=None,
        cached_tokens=None,
        hit=HitTiers(0, 0, 0, prompt_tokens),
        est_ttft_s=0.0,
    )


async def same_index(gw: Gateway, fleet: Fleet, prompts: list[list[int]]) -> None:
    for hashes in prompts:
        assert await gw.index.lookup(MODEL, hashes) == fleet.index.lookup_now(MODEL, hashes)


class StillClock:
    """The gateway's clocks at one instant (the replay's clock does not move within an
    arrival either)."""

    @staticmethod
    def perf_counter() -> float:
        return 1000.0

    @staticmethod
    def monotonic() -> float:
        return 1000.0


@pytest.fixture
def still_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway.fleet.registry, "time", StillClock)
    monkeypatch.setattr(gateway.fleet.replica, "time", StillClock)
    monkeypatch.setattr(gateway.serving.planner, "time", StillClock)


@pytest.mark.usefixtures("still_clock")
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
async def test_gateway_and_replay_route_alike(case: Case, stream: bool) -> None:
    cfg = parse_config(
        {"engine_metrics": {"enabled": False}, "pools": list(case.pools), **case.overrides}
    )
    gw = Gateway(cfg)
    for replica in gw.registry.replicas.values():
        await gw.registry.mark_ok(replica, frozenset())
        # the replay replays the model itself: its estimates have the final word, as the
        # gateway's do once they have been right (routing/authority.py)
        replica.estimate_error = EstimateError(log_error=0.0)
    fleet = replay_fleet(gw, cfg)

    def hashed(tenant: Tenant, text: str) -> tuple[list[int], int]:
        body = {"model": MODEL, "prompt": text}
        salts = (None, engine_salt(tenant, None))
        p = gw.hasher.hashed("completions", body, MODEL, tenant, salts)
        return p.hashes, p.prompt_tokens

    for seed in case.seeded:
        hashes = hashed(TENANTS[S], seed.text)[0][: seed.blocks]
        await record_prompt(gw.index, MODEL, hashes, seed.where)
        fleet.index.record_now(MODEL, hashes[::-1], seed.where)
    prompts: list[list[int]] = []
    arrivals: list[Arrival] = []
    seen: set[str] = set()
    for n, (klass, text) in enumerate(case.steps):
        tenant = TENANTS[klass]
        hashes, tokens = hashed(tenant, text)
        prompts.append(hashes)
        theirs = await gw.route(tenant, text, stream)
        arrival = fleet.arrive(captured(tenant, hashes, tokens, stream))
        arrivals.append(arrival)
        assert replayed(arrival) == theirs, f"request {n} ({klass.value})"
        seen |= labels(klass, theirs)
        await same_index(gw, fleet, prompts)
    await gw.first_bytes()
    for arrival in arrivals:
        fleet.record_index(MODEL, arrival.first_byte_writes)
    await same_index(gw, fleet, prompts)
    assert case.expect <= seen, "the case no longer takes the path it is named for"


def labels(klass: TenantClass, routed: Routed) -> set[str]:
    """What a routing did, for the table's `expect`."""
    out = {f"{klass.value}@{(routed.replica or '-').split('-')[0]}"}
    if routed.refused:
        out.add(routed.refused)
    if routed.fallback:
        out.add(routed.fallback)
    if routed.reason:
        out.add(routed.reason)
    if routed.remote_write:
        out.add("remote_write")
    return out
