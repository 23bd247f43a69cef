"""gateway/serving/prewarm.py: what a hot prefix enqueues, what the worker sends (MockTransport)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from gateway.config import GatewayConfig, parse_config
from gateway.fleet.registry import Registry
from gateway.index.reuse import ReuseCounter
from gateway.serving.planner import Plan, Planner
from gateway.serving.prewarm import Prewarmer
from gateway.telemetry.metrics import Metrics
from gateway.tenancy.tenants import Tenant
from routing.index import MemoryIndex, record_prompt
from routing.prompt import approx_tokens, chat_text
from routing.types import Location, TenantClass, Tier

MODEL = "m"
PINNED = [f"http://pinned-{i}:8000" for i in range(4)]
SHARED = ["http://shared-0:8000"]
CRITICAL = Tenant("voice", TenantClass.CRITICAL)
STANDARD = Tenant("acme", TenantClass.STANDARD)
SYSTEM = "You are the voice agent of a bank. Answer in one sentence. " * 20  # ~300 tokens
SETTLE_STEPS = 2_000  # bounded waits: event-loop turns of 1 ms at most


def chat_body(user: str = "What is my balance?") -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": user},
        ],
    }


def completion_body() -> dict[str, Any]:
    return {"model": MODEL, "prompt": SYSTEM + "Q: What is my balance?\nA:"}


class Setup:
    def __init__(self, pinned: int = 3, **prewarm: Any) -> None:
        # hot at once, and warms 1 ms apart, unless a test says otherwise
        warming: dict[str, Any] = {"enabled": True, "hot_after": 1, "max_per_s": 1000.0}
        warming.update(prewarm)
        pinned_pool: dict[str, Any] = {
            "name": "pinned",
            "replicas": PINNED[:pinned],
            "models": [MODEL],
            "pinned": True,
            # a tier below HBM: critical cost placement prefers these replicas at a close cost
            "cpu_capacity_tokens": 100_000,
        }
        data: dict[str, Any] = {
            "engine_metrics": {"enabled": False},
            "prewarm": warming,
            "pools": [{"name": "shared", "replicas": SHARED, "models": [MODEL]}, pinned_pool],
        }
        cfg: GatewayConfig = parse_config(data)
        self.metrics = Metrics()
        self.registry = Registry(cfg)
        self.index = MemoryIndex()
        self.planner = Planner(
            cfg, self.registry, self.index, ReuseCounter(self.metrics), self.metrics
        )
        self.sent: list[httpx.Request] = []
        self.client = httpx.AsyncClient(transport=httpx.MockTransport(self._replica))
        self.prewarmer = Prewarmer(
            cfg.prewarm,
            self.client,
            self.registry,
            self.index,
            self.metrics,
            block_size_tokens=cfg.routing.block_size_tokens,
        )
        self.pinned = {u.removeprefix("http://") for u in PINNED[:pinned]}

    def _replica(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        return httpx.Response(200, json={"choices": [{"text": "."}]})

    async def admit_all(self) -> Setup:
        for replica in self.registry.replicas.values():
            await self.registry.mark_ok(replica, frozenset())
        return self

    async def plan(
        self, body: dict[str, Any], tenant: Tenant = CRITICAL, *, dry_run: bool = False
    ) -> Plan:
        endpoint = "chat" if "messages" in body else "completions"
        return await self.planner.plan(endpoint, body, tenant, dry_run=dry_run)

    def counted(self, outcome: str, trigger: str = "critical") -> float:
        labels = {"trigger": trigger, "outcome": outcome}
        return self.metrics.registry.get_sample_value("cachelane_prewarms_total", labels) or 0.0

    def sent_to(self) -> list[str]:
        return [f"{r.url.host}:{r.url.port}" for r in self.sent]

    @asynccontextmanager
    async def worker(self) -> AsyncIterator[None]:
        task = asyncio.create_task(self.prewarmer.run())
        try:
            yield
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await self.client.aclose()

    async def settle(self) -> None:
        """Until the worker has handled every queued warm (bounded)."""
        for _ in range(SETTLE_STEPS):
            if self.prewarmer.idle:
                return
            await asyncio.sleep(0.001)
        raise AssertionError("the prewarm worker did not drain its queue")


async def setup(pinned: int = 3, **prewarm: Any) -> Setup:
    return await Setup(pinned, **prewarm).admit_all()


async def test_a_hot_critical_prefix_is_warmed_on_the_pinned_replicas_that_lack_it() -> None:
    s = await setup(pinned=3, hot_after=2)
    names = sorted(s.pinned)
    holder = names[0]
    # the holder has the whole conversation in HBM, but a long queue: the request goes elsewhere
    first = await s.plan(chat_body(), dry_run=True)
    await record_prompt(s.index, MODEL, first.hashes, Location(holder, Tier.HBM))
    s.registry.reserve(s.registry.replicas[holder], prefill_tokens=10_000_000, swaps=0)

    plan = await s.plan(chat_body())
    assert plan.decision.replica in s.pinned - {holder}
    s.prewarmer.consider(plan)  # seen once: not hot yet
    assert s.prewarmer.idle
    assert s.counted("queued") == 0

    plan = await s.plan(chat_body())  # seen twice: hot
    s.prewarmer.consider(plan)
    [lacking] = s.pinned - {holder, plan.decision.replica}
    assert s.counted("queued") == 1
    async with s.worker():
        await s.settle()
    assert s.sent_to() == [lacking]  # not the holder, not the chosen one, no shared replica
    assert s.counted("warmed") == 1

    # the warmed replica is now indexed as holding the system prompt in HBM
    prefix = await s.plan({"model": MODEL, "messages": chat_body()["messages"][:1]}, dry_run=True)
    hits = await s.index.lookup(MODEL, prefix.hashes)
    assert len(hits) == len(prefix.hashes) > 0
    assert all(Location(lacking, Tier.HBM) in h for h in hits)


async def test_a_standard_tenants_hot_prefix_warms_no_pinned_replica() -> None:
    s = await setup(pinned=3)
    for _ in range(3):
        s.prewarmer.consider(await s.plan(chat_body(), STANDARD))
    assert s.prewarmer.idle
    assert s.counted("queued") == 0


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_a_warm_is_a_prefill_only_request_of_the_prefix(endpoint: str) -> None:
    s = await setup(pinned=2)
    body = chat_body() if endpoint == "chat" else completion_body()
    plan = await s.plan(body)
    s.prewarmer.consider(plan)
    async with s.worker():
        await s.settle()
    [request] = s.sent
    sent = json.loads(request.content)
    assert sent["max_tokens"] == 1
    assert sent["stream"] is False
    assert sent["model"] == MODEL
    assert request.method == "POST"
    assert request.headers["x-cachelane-remote-write"] == "0"
    if endpoint == "chat":
        assert request.url.path == "/v1/chat/completions"
        assert sent["messages"] == body["messages"][:1]  # the system prompt only
    else:
        assert request.url.path == "/v1/completions"
        assert sent["prompt"] == body["prompt"]


async def test_the_token_budget_bounds_what_is_sent() -> None:
    warm_tokens = approx_tokens(chat_text(chat_body()["messages"][:1]))  # the system prompt
    s = await setup(pinned=4, budget_tokens_per_min=warm_tokens * 3 // 2)  # one warm, not two
    s.prewarmer.consider(await s.plan(chat_body()))
    assert s.counted("queued") == 3
    async with s.worker():
        await s.settle()
    assert len(s.sent) == 1
    assert s.counted("warmed") == 1
    assert s.counted("skipped_budget") == 2


async def test_max_per_s_spaces_the_warms() -> None:
    s = await setup(pinned=3, max_per_s=0.01)  # one warm, then 100 s before the next
    s.prewarmer.consider(await s.plan(chat_body()))
    assert s.counted("queued") == 2
    async with s.worker():
        for _ in range(SETTLE_STEPS):
            if s.sent:
                break
            await asyncio.sleep(0)
        assert len(s.sent) == 1
        for _ in range(200):  # the worker gets every chance to send the second: it must not
            await asyncio.sleep(0)
        assert len(s.sent) == 1
        assert not s.prewarmer.idle


async def test_a_full_queue_drops_instead_of_blocking() -> None:
    s = await setup(pinned=4, queue_size=1)
    plan = await s.plan(chat_body())
    s.prewarmer.consider(plan)  # three pinned replicas lack the prefix; room for one
    assert s.counted("queued") == 1
    assert s.counted("dropped_queue_full") == 2
    s.prewarmer.consider(plan)  # the queued one is not queued twice; the others drop again
    assert s.counted("queued") == 1
    assert s.counted("dropped_queue_full") == 4
    async with s.worker():
        await s.settle()
    assert len(s.sent) == 1


async def test_a_warm_already_queued_is_not_queued_again() -> None:
    s = await setup(pinned=3)
    plan = await s.plan(chat_body())
    s.prewarmer.consider(plan)
    s.prewarmer.consider(plan)
    assert s.counted("queued") == 2  # one per pinned replica lacking it, once
    async with s.worker():
        await s.settle()
    assert sorted(s.sent_to()) == sorted(s.pinned - {plan.decision.replica})
