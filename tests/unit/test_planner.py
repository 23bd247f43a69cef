"""gateway/serving/planner.py with a real in-process index (MemoryIndex) and registry."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import pytest

from gateway.config import GatewayConfig, parse_config
from gateway.fleet.registry import Registry
from gateway.http.errors import ApiError
from gateway.index.reuse import ReuseCounter
from gateway.serving.planner import Plan, Planner
from gateway.telemetry.metrics import Metrics
from gateway.tenancy.tenants import Tenant
from routing.admission import AdmissionVerdict
from routing.decide import Reason
from routing.filters import Fallback
from routing.index import MemoryIndex, record_prompt
from routing.speculative import SpeculativeIndex
from routing.types import Location, TenantClass, Tier

MODEL = "m"
SHARED = ["http://replica-a:8000", "http://replica-b:8000", "http://replica-c:8000"]
PINNED = ["http://pinned-a:8000", "http://pinned-b:8000"]
# Slow enough that a cached 1,000-token prefix saves 10 ms, well past decide()'s near tie (2 ms).
COSTS = {"prefill_tokens_per_s": 100_000.0}
STANDARD = Tenant("acme", TenantClass.STANDARD)
CRITICAL = Tenant("voice", TenantClass.CRITICAL)
SYSTEM = "You are a careful assistant. " * 140  # ~4,000 characters, ~1,000 tokens


def pool(name: str, urls: list[str], **extra: Any) -> dict[str, Any]:
    return {"name": name, "replicas": urls, "models": [MODEL], "costs": COSTS, **extra}


def config(*pools: dict[str, Any], **overrides: Any) -> GatewayConfig:
    data: dict[str, Any] = {
        "engine_metrics": {"enabled": False},
        "pools": list(pools) or [pool("shared", SHARED)],
        **overrides,
    }
    return parse_config(data)


def chat(user: str = "What is the weather?", *, model: str = MODEL) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": user},
        ],
    }


class Setup:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.config = cfg
        self.metrics = Metrics()
        self.registry = Registry(cfg)
        self.index = MemoryIndex()  # what the gateway recorded
        self.routing = SpeculativeIndex(self.index)  # what routing reads, as gateway/wiring.py
        reuse = ReuseCounter(self.metrics)
        self.planner = Planner(cfg, self.registry, self.routing, reuse, self.metrics, self.routing)

    async def admit_all(self) -> Setup:
        for replica in self.registry.replicas.values():
            await self.registry.mark_ok(replica, frozenset())
        return self

    def names(self, urls: list[str]) -> set[str]:
        return {u.removeprefix("http://") for u in urls}

    async def plan(
        self, body: dict[str, Any], tenant: Tenant = STANDARD, *, endpoint: str = "chat"
    ) -> Plan:
        return await self.planner.plan(endpoint, body, tenant)


async def setup(cfg: GatewayConfig | None = None) -> Setup:
    return await Setup(cfg or config()).admit_all()


@pytest.mark.parametrize("holder", [0, 1, 2])
async def test_a_request_goes_to_the_replica_whose_hbm_holds_its_prefix(holder: int) -> None:
    s = await setup()
    cold = await s.plan(chat())
    assert cold.decision.reason is Reason.COLD
    name = SHARED[holder].removeprefix("http://")
    await record_prompt(s.index, MODEL, cold.hashes, Location(name, Tier.HBM))

    again = await s.plan(chat())
    assert again.decision.replica == name
    assert again.decision.reason is Reason.HBM_HIT
    assert again.decision.expected_cached_tokens >= 900  # the prompt, to the last full block
    # the next turn of the conversation shares the prefix and follows it
    follow_up = await s.plan(chat("And tomorrow? Please be brief and precise."))
    assert follow_up.decision.replica == name


async def test_a_prefix_cached_for_one_tenant_is_no_hit_for_another() -> None:
    s = await setup()
    first = await s.plan(chat(), STANDARD)
    where = Location(SHARED[1].removeprefix("http://"), Tier.HBM)
    await record_prompt(s.index, MODEL, first.hashes, where)
    other = await s.plan(chat(), Tenant("globex", TenantClass.STANDARD))
    assert other.decision.reason is Reason.COLD
    assert other.decision.expected_cached_tokens == 0
    # tenants of one share group see each other's prefixes
    a, b = Tenant("a", TenantClass.STANDARD, "team"), Tenant("b", TenantClass.STANDARD, "team")
    mine = await s.plan(chat(), a)
    await record_prompt(s.index, MODEL, mine.hashes, where)
    theirs = await s.plan(chat(), b)
    assert theirs.decision.replica == where.holder
    assert theirs.decision.reason is Reason.HBM_HIT


async def test_an_unknown_model_is_404_model_not_found() -> None:
    s = await setup()
    with pytest.raises(ApiError) as caught:
        await s.plan(chat(model="gpt-nope"))
    err = caught.value
    assert err.status == 404
    assert err.envelope()["error"]["code"] == "model_not_found"
    assert err.envelope()["error"]["type"] == "invalid_request_error"
    assert err.envelope()["error"]["param"] == "model"
    assert "gpt-nope" in err.envelope()["error"]["message"]


async def test_a_missing_model_is_400() -> None:
    s = await setup()
    body = chat()
    del body["model"]
    with pytest.raises(ApiError) as caught:
        await s.plan(body)
    assert caught.value.status == 400
    assert caught.value.param == "model"


@pytest.mark.parametrize(("endpoint", "param"), [("chat", "messages"), ("completions", "prompt")])
async def test_a_prompt_over_the_pools_limit_is_rejected(endpoint: str, param: str) -> None:
    s = await setup(config(pool("shared", SHARED, max_prompt_tokens=100)))

    def body(chars: int) -> dict[str, Any]:
        if endpoint == "chat":
            # "<|user|>" + content + "\n" is 9 characters of the rendered prompt
            return {"model": MODEL, "messages": [{"role": "user", "content": "x" * (chars - 9)}]}
        return {"model": MODEL, "prompt": "x" * chars}

    at_limit = await s.plan(body(400), endpoint=endpoint)  # 400 characters: ~100 tokens
    assert at_limit.prompt_tokens == 100
    with pytest.raises(ApiError) as caught:
        await s.plan(body(404), endpoint=endpoint)
    err = caught.value
    assert err.status == 400
    assert err.code == "context_length_exceeded"
    assert err.param == param
    assert err.envelope()["error"]["type"] == "invalid_request_error"


async def test_no_healthy_replica_is_503_with_retry_after() -> None:
    s = Setup(config())  # no replica passed a health check
    with pytest.raises(ApiError) as caught:
        await s.plan(chat())
    assert caught.value.status == 503
    assert caught.value.code == "no_healthy_replica"
    assert "retry-after" in caught.value.headers


def tiered(lend_below: float | None = 1.0, **critical: Any) -> GatewayConfig:
    return config(
        pool("shared", SHARED),
        pool(
            "pinned",
            PINNED,
            pinned=True,
            hbm_only=True,
            admission={"max_in_flight": 1},
            lend_below=lend_below,
        ),
        critical=critical,
    )


async def test_by_default_a_critical_follow_up_goes_where_its_context_is() -> None:
    s = await setup(tiered())
    first = await s.plan(chat(), CRITICAL)
    # cold everywhere: a shared replica, whose tier below HBM keeps the context (the pinned pool
    # is HBM-only)
    assert first.decision.replica in s.names(SHARED)
    holder = Location(SHARED[0].removeprefix("http://"), Tier.HBM)
    await record_prompt(s.index, MODEL, first.hashes, holder)
    plan = await s.plan(chat(), CRITICAL)  # its context saves ~10 ms of ~13 on a shared one
    assert plan.decision.replica == holder.holder
    assert plan.fallback is Fallback.SPILL
    assert not s.planner.pinned.reclaimed(time.monotonic())  # a pinned replica was idle


async def test_pinned_first_keeps_critical_on_its_pool_and_no_lending_keeps_standard_off() -> None:
    s = await setup(tiered(lend_below=None, placement="pinned_first"))
    pinned, shared = s.names(PINNED), s.names(SHARED)
    # even with its prefix cached on a shared replica, critical stays on the pinned pool
    first = await s.plan(chat(), CRITICAL)
    holder = Location(SHARED[0].removeprefix("http://"), Tier.HBM)
    await record_prompt(s.index, MODEL, first.hashes, holder)
    for _ in range(4):
        plan = await s.plan(chat(), CRITICAL)
        assert plan.decision.replica in pinned
        assert {sc.replica for sc in plan.decision.scores} <= pinned
        assert plan.fallback is None
        standard = await s.plan(chat(), STANDARD)
        assert standard.decision.replica in shared
        assert {sc.replica for sc in standard.decision.scores} <= shared


async def test_a_full_pinned_pool_rejects_critical_when_told_to() -> None:
    s = await setup(tiered(fallback="reject", retry_after_s=7))
    for name in s.names(PINNED):  # each pinned replica at its admission cap (1 in flight)
        s.registry.reserve(s.registry.replicas[name], prefill_tokens=10, swaps=0)
    with pytest.raises(ApiError) as caught:
        await s.plan(chat(), CRITICAL)
    assert caught.value.status == 503
    assert caught.value.code == "pinned_pool_unavailable"
    assert caught.value.headers["retry-after"] == "7"


async def test_a_full_pinned_pool_spills_critical_to_the_shared_pools() -> None:
    s = await setup(tiered(fallback="spill"))
    for name in s.names(PINNED):
        s.registry.reserve(s.registry.replicas[name], prefill_tokens=10, swaps=0)
    plan = await s.plan(chat(), CRITICAL)
    assert plan.decision.replica in s.names(SHARED)
    assert plan.fallback is Fallback.SPILL


async def test_record_sent_indexes_the_prompt_on_the_chosen_replica() -> None:
    s = await setup()
    plan = await s.plan(chat())
    chosen = s.registry.replicas[plan.decision.replica]
    assert await s.index.lookup(MODEL, plan.hashes) == []
    await s.planner.record_sent(plan, chosen)

    hits = await s.index.lookup(MODEL, plan.hashes)
    assert len(hits) == len(plan.hashes) > 0
    assert all(h == {Location(chosen.name, Tier.HBM)} for h in hits)
    # the next request with this prefix is sent where the first one went
    follow_up = await s.plan(chat("A different question, same system prompt."))
    assert follow_up.decision.replica == chosen.name
    assert follow_up.decision.reason is Reason.HBM_HIT


async def swapping_in(s: Setup, *, stream: bool) -> tuple[Plan, list[int]]:
    """A request sent where 40 blocks of its system prompt wait in the CPU tier."""
    cold = await s.plan(chat())
    name = SHARED[1].removeprefix("http://")
    swapped = cold.hashes[:40]
    await record_prompt(s.index, MODEL, swapped, Location(name, Tier.CPU))
    plan = await s.plan(chat() | {"stream": stream})
    assert plan.decision.replica == name
    assert plan.decision.reason is Reason.CPU_HIT
    await s.planner.record_sent(plan, s.registry.replicas[name])
    return plan, swapped


def in_hbm(index: MemoryIndex, plan: Plan) -> list[bool]:
    hbm = Location(plan.decision.replica, Tier.HBM)
    return [hbm in held for held in index.lookup_now(MODEL, plan.hashes)]


@pytest.mark.parametrize("stream", [True, False])
async def test_a_prompt_is_in_hbm_once_its_swap_in_is_done(stream: bool) -> None:
    s = await setup(config(pool("shared", SHARED, cpu_capacity_tokens=100_000)))
    plan, swapped = await swapping_in(s, stream=stream)
    # until its swap-in is done, the engine has not cached its prompt: nothing is recorded in
    # HBM, but routing sees the blocks it does not load as there (a follow-up goes there too)
    assert not any(in_hbm(s.index, plan))
    marked = await s.routing.lookup(MODEL, plan.hashes)
    hbm = Location(plan.decision.replica, Tier.HBM)
    assert [hbm in held for held in marked] == [False] * len(swapped) + [True] * (
        len(plan.hashes) - len(swapped)
    )
    loaded_after_s = plan.decision.score().estimate.load_s
    assert 0.0 < loaded_after_s < 0.05
    await asyncio.sleep(loaded_after_s + 0.05)  # the timer, at the swap-in's estimated end
    assert all(in_hbm(s.index, plan))
    await s.planner.record_loaded(plan, s.registry.replicas[plan.decision.replica])
    assert all(in_hbm(s.index, plan))


async def test_a_first_byte_before_the_loads_estimated_end_records_the_prompt() -> None:
    s = await setup(config(pool("shared", SHARED, cpu_capacity_tokens=100_000)))
    plan, _ = await swapping_in(s, stream=True)
    assert not any(in_hbm(s.index, plan))
    await s.planner.record_loaded(plan, s.registry.replicas[plan.decision.replica])
    assert all(in_hbm(s.index, plan))


async def test_a_request_sent_again_is_recorded_where_it_went_last() -> None:
    s = await setup(config(pool("shared", SHARED, cpu_capacity_tokens=100_000)))
    plan, _ = await swapping_in(s, stream=True)
    first = plan.decision.replica
    other = next(r for r in s.registry.replicas.values() if r.name != first)
    await s.planner.record_sent(plan, other)  # a retry, before the first one's load was done
    await asyncio.sleep(plan.decision.score().estimate.load_s + 0.05)
    assert not any(in_hbm(s.index, plan))  # the replica it left: nothing
    hbm = Location(other.name, Tier.HBM)
    assert all(hbm in held for held in s.index.lookup_now(MODEL, plan.hashes))


@pytest.mark.parametrize("answered", [True, False])
async def test_a_request_that_ends_before_its_loads_estimated_end(answered: bool) -> None:
    s = await setup(config(pool("shared", SHARED, cpu_capacity_tokens=100_000)))
    plan, _ = await swapping_in(s, stream=False)
    s.planner.settle_loaded(plan, answered=answered)
    await asyncio.sleep(0.01)  # the record runs as a task
    # an answer's prompt was cached; a failed request's engine may never have scheduled it
    assert all(in_hbm(s.index, plan)) is answered
    assert any(in_hbm(s.index, plan)) is answered


@pytest.mark.parametrize("stream", [True, False])
async def test_the_remote_tier_holds_a_written_prompt_once_its_prefill_is_done(
    stream: bool,
) -> None:
    """A streamed request writes its blocks to the remote tier as its prefill runs: until its
    first byte a request on another replica would find none there. A whole answer's first byte
    comes after its prefill: recorded when it is sent."""
    cfg = config(
        pool("shared", SHARED, remote_tier="kv"),
        remote_tiers=[{"name": "kv", "url": "http://kv:9100"}],
    )
    s = await setup(cfg)
    plan = await s.plan(chat() | {"stream": stream})
    write = AdmissionVerdict(True, 2.0, 0.1, 0.01, len(plan.hashes) * 16)
    plan = replace(plan, admission=write)
    replica = s.registry.replicas[plan.decision.replica]
    remote = Location("kv", Tier.REMOTE)

    def in_remote() -> bool:
        return all(remote in held for held in s.index.lookup_now(MODEL, plan.hashes))

    await s.planner.record_sent(plan, replica)
    assert in_remote() is not stream
    await s.planner.record_loaded(plan, replica)
    assert in_remote()


async def test_within_budget_while_some_candidate_has_an_empty_prefill_queue() -> None:
    s = await setup()
    plan = await s.plan(chat())
    # the request's own ~10 ms prefill is over a 1 us budget: an empty queue lets it go anyway
    assert s.planner.within_budget(plan, 1e-6)

    replicas = list(s.registry.replicas.values())
    held = [
        s.registry.reserve(r, prefill_tokens=100_000, swaps=0)  # ~1 s of prefill queued
        for r in replicas[:-1]
    ]
    assert s.planner.within_budget(plan, 0.5)  # the last replica's queue is still empty
    held.append(s.registry.reserve(replicas[-1], prefill_tokens=100_000, swaps=0))
    assert not s.planner.within_budget(plan, 0.5)
    assert s.planner.within_budget(plan, 5.0)  # ~1 s fits a 5 s budget

    held[0].release()
    assert s.planner.within_budget(plan, 0.5)
