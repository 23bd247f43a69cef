"""A real gateway in front of real simulated replicas, all uvicorn servers on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from gateway.config import GatewayConfig, parse_config
from gateway.http.app import create_app
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from routing.cost import PoolCosts
from tests.helpers.servers import running_app

MODEL = "sim-llama-8b"
# Fast constants so the suite runs in seconds; the cost model's ratios are unchanged.
FAST_COSTS = PoolCosts(prefill_tokens_per_s=3_000_000.0)
# Slow enough that a cached 500-token prefix saves more than decide()'s 2 ms near-tie (5 ms):
# with FAST_COSTS a short prompt's hit and miss tie, and the seeded rng picks the replica.
CACHE_VISIBLE_COSTS = PoolCosts(prefill_tokens_per_s=100_000.0)


@dataclass
class Fleet:
    gateway_url: str
    replica_urls: list[str]
    app: Any
    stack: AsyncExitStack
    replica_stacks: list[AsyncExitStack] = field(default_factory=list)

    @property
    def gw(self) -> Any:
        return self.app.state.gw

    async def kill_replica(self, i: int) -> None:
        await self.replica_stacks[i].aclose()


CLASS_KEYS = {
    "voice": "voice-key-123-0123456789abcdef0123456789",
    "web": "web-key-1234-0123456789abcdef0123456789",
    "bulk": "bulk-key-123-0123456789abcdef0123456789",
}
# API keys of the tenants the class tests name after their traffic: voice (critical), web
# (standard) and bulk (batch).

TEST_AUTH_SECRET = "test-secret-" + "0" * 32  # signs tenant records in Redis (auth.secret)


def with_auth(data: dict[str, Any]) -> dict[str, Any]:
    """A test config's auth section, unless it gives one: open when it names no tenant and no
    admin key (auth is keys unless a config says otherwise), else keys with a secret for Redis."""
    if "auth" in data:
        return data
    if not data.get("tenants") and not data.get("admin"):
        return {**data, "auth": {"mode": "open"}}
    return {**data, "auth": {"mode": "keys", "secret": TEST_AUTH_SECRET}}


QUICK_CHECKS: dict[str, Any] = {
    "health": {"interval_s": 0.2, "timeout_s": 0.5, "fail_after": 1},
    "engine_metrics": {"enabled": False},
}
# A test config's checks: health every 0.2 s, a replica out after one failed check (tests wait for
# it, bounded); no scraping of engine /metrics.


def default_pool(replicas: list[str], costs: PoolCosts, **extra: Any) -> dict[str, Any]:
    """A test config's one pool, "default", serving MODEL from `replicas` at `costs`."""
    return {
        "name": "default",
        "models": [MODEL],
        "replicas": replicas,
        **extra,
        "costs": {"prefill_tokens_per_s": costs.prefill_tokens_per_s},
    }


def gateway_config(
    replica_urls: list[str],
    costs: PoolCosts = FAST_COSTS,
    *,
    pool: dict[str, Any] | None = None,
    **overrides: Any,
) -> GatewayConfig:
    """The config of a gateway before `replica_urls` in one pool ("default", `pool`'s keys added
    to it), the test's quick checks and its `overrides`."""
    extra = {"max_prompt_tokens": 50_000, **(pool or {})}
    data: dict[str, Any] = {**QUICK_CHECKS, "pools": [default_pool(replica_urls, costs, **extra)]}
    data.update(overrides)
    return parse_config(with_auth(data))


@asynccontextmanager
async def fleet(
    n: int = 3, *, costs: PoolCosts = FAST_COSTS, itl_s: float = 0.001, **overrides: Any
) -> AsyncIterator[Fleet]:
    """`n` simulated replicas behind one gateway; the sims and the gateway share `costs`."""
    async with AsyncExitStack() as stack:
        urls, stacks = [], []
        for i in range(n):
            replica_stack = AsyncExitStack()
            spec = SimReplicaSpec(name=f"sim-{i}", port=0, costs=costs, itl_s=itl_s)
            urls.append(await replica_stack.enter_async_context(running_app(create_sim_app(spec))))
            stack.push_async_callback(replica_stack.aclose)
            stacks.append(replica_stack)
        app = create_app(gateway_config(urls, costs, **overrides))
        gateway_url = await stack.enter_async_context(running_app(app))
        yield Fleet(gateway_url, urls, app, stack, stacks)


@dataclass
class PoolSpec:
    """A pool of simulated replicas for `tiered_fleet`; `config` goes into the pool's YAML."""

    name: str
    replicas: int
    config: dict[str, Any] = field(default_factory=dict)
    cpu_capacity_tokens: int = 0
    remote: bool = False
    costs: PoolCosts = FAST_COSTS


@dataclass
class TieredFleet:
    gateway_url: str
    app: Any
    pools: dict[str, list[str]]  # pool name -> replica names (host:port)
    remote_url: str | None
    replica_stacks: dict[str, AsyncExitStack]

    @property
    def gw(self) -> Any:
        return self.app.state.gw

    async def kill(self, replica: str) -> None:
        await self.replica_stacks[replica].aclose()


@asynccontextmanager
async def tiered_fleet(pools: list[PoolSpec], **overrides: Any) -> AsyncIterator[TieredFleet]:
    """Pools of simulated replicas (optionally with CPU tiers and one shared remote tier) behind
    one gateway."""
    from loadtest.sim.config import RemoteTierSpec
    from loadtest.sim.remote import create_remote_app

    async with AsyncExitStack() as stack:
        remote_url = None
        if any(p.remote for p in pools):
            remote_app = create_remote_app(RemoteTierSpec(name="kv", port=0))
            remote_url = await stack.enter_async_context(running_app(remote_app))
        pool_configs, names, stacks = [], {}, {}
        for pool in pools:
            urls = []
            for i in range(pool.replicas):
                spec = SimReplicaSpec(
                    name=f"{pool.name}-{i}",
                    port=0,
                    costs=pool.costs,
                    itl_s=0.001,
                    cpu_capacity_tokens=pool.cpu_capacity_tokens,
                    remote_url=remote_url if pool.remote else None,
                )
                replica_stack = AsyncExitStack()
                url = await replica_stack.enter_async_context(running_app(create_sim_app(spec)))
                stack.push_async_callback(replica_stack.aclose)
                stacks[url.removeprefix("http://")] = replica_stack
                urls.append(url)
            names[pool.name] = [u.removeprefix("http://") for u in urls]
            pool_configs.append(
                {
                    "name": pool.name,
                    "models": [MODEL],
                    "replicas": urls,
                    "cpu_capacity_tokens": pool.cpu_capacity_tokens,
                    "remote_tier": "kv" if pool.remote else None,
                    "costs": {"prefill_tokens_per_s": pool.costs.prefill_tokens_per_s},
                    **pool.config,
                }
            )
        data: dict[str, Any] = {
            "health": {"interval_s": 0.2, "timeout_s": 0.5, "fail_after": 1},
            "engine_metrics": {"enabled": False},
            "remote_tiers": [{"name": "kv", "url": remote_url}] if remote_url else [],
            "pools": pool_configs,
        }
        data.update(overrides)
        app = create_app(parse_config(with_auth(data)))
        gateway_url = await stack.enter_async_context(running_app(app))
        yield TieredFleet(gateway_url, app, names, remote_url, stacks)
