"""gateway/fleet/membership.py: replicas joining and leaving, and what each change reaches.

The replicas' URLs refuse connections (ports 1-3 on loopback), so the health check run as a
replica joins fails at once and nothing else is contacted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gateway.accounting.calibration import CostLearner
from gateway.config import GatewayConfig, PoolConfig, parse_config
from gateway.fleet.health_checks import HealthChecker
from gateway.fleet.membership import Fleet
from gateway.fleet.registry import Registry
from gateway.telemetry.metrics import Metrics
from routing.index import MemoryIndex
from routing.types import Location, Tier

U1, U2, U3 = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"
N1, N2, N3 = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"


def config(replicas: list[str], **pool: Any) -> GatewayConfig:
    return parse_config(
        {
            "auth": {"mode": "open"},
            "health": {"timeout_s": 0.5},
            "pools": [{"name": "p", "models": ["m"], "replicas": replicas, **pool}],
        }
    )


@dataclass
class Parts:
    fleet: Fleet
    registry: Registry
    learner: CostLearner
    index: MemoryIndex
    metrics: Metrics


@pytest.fixture
async def parts() -> AsyncIterator[Parts]:
    c = config([U1, U2])
    registry = Registry(c)
    metrics = Metrics()
    learner = CostLearner("fit", registry.replicas.values(), metrics)
    index = MemoryIndex()
    async with httpx.AsyncClient(trust_env=False) as client:
        health = HealthChecker(registry, client, interval_s=1.0, timeout_s=0.5)
        fleet = Fleet(
            c.pools,
            registry,
            learner,
            index,
            metrics,
            health,
            None,
            drain_timeout_s=30.0,
        )
        yield Parts(fleet, registry, learner, index, metrics)
        await fleet.aclose()


def gauge(metrics: Metrics, name: str, replica: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"replica": replica})


async def drained(fleet: Fleet, name: str) -> None:
    for _ in range(250):  # DRAIN_POLL_S is 0.2 s: a few polls
        if name not in fleet.draining:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{name} did not drain")


async def test_a_leaving_replica_drains_then_lets_go(parts: Parts) -> None:
    r1 = parts.registry.replicas[N1]
    await parts.index.record("m", [1, 2, 3], Location(N1, Tier.HBM))
    reservation = parts.registry.reserve(r1, prefill_tokens=10, swaps=0)

    changes = await parts.fleet.set_pools(config([U2, U3]).pools)
    assert (changes.added, changes.removed) == ([N3], [N1])
    assert set(parts.registry.replicas) == {N2, N3}
    assert r1.retired and not r1.healthy  # no new request; the reserved one goes on
    assert parts.index.size(Location(N1, Tier.HBM)) == 0  # dropped as it left
    assert parts.fleet.draining == {N1}
    await asyncio.sleep(0.5)
    assert parts.fleet.draining == {N1}, "still a request in flight"
    assert N1 in parts.learner.describe()["replicas"]

    await parts.index.record("m", [4], Location(N1, Tier.HBM))  # sent meanwhile
    reservation.release()
    await drained(parts.fleet, N1)
    assert N1 not in parts.learner.describe()["replicas"]
    assert gauge(parts.metrics, "cachelane_replica_healthy", N1) is None
    assert parts.index.size(Location(N1, Tier.HBM)) == 0  # dropped again once drained
    assert gauge(parts.metrics, "cachelane_replica_healthy", N3) == 0  # joined, not answering


async def test_a_replica_back_while_draining_keeps_its_load(parts: Parts) -> None:
    r1 = parts.registry.replicas[N1]
    parts.registry.reserve(r1, prefill_tokens=10, swaps=0)
    await parts.fleet.set_pools(config([U2]).pools)
    assert parts.fleet.draining == {N1}

    changes = await parts.fleet.set_pools(config([U1, U2]).pools)
    assert changes.added == [N1]
    assert parts.registry.replicas[N1] is r1  # the same replica: its request still counts
    assert r1.in_flight == 1 and not r1.retired
    assert parts.fleet.draining == set()


async def test_a_changed_pool_reconfigures_its_replicas_in_place(parts: Parts) -> None:
    r2 = parts.registry.replicas[N2]
    pools = config([U1, U2], pinned=True, costs={"prefill_tokens_per_s": 1000.0}).pools
    changes = await parts.fleet.set_pools(pools)
    assert changes.moved == [N1, N2] and not changes.added and not changes.removed
    assert parts.registry.replicas[N2] is r2
    assert r2.pool.pinned and r2.rules.pinned
    assert r2.costs.prefill_tokens_per_s == 1000.0
    seeded = parts.learner.describe()["replicas"][N2]
    assert seeded["prefill_tokens_per_s"] == pytest.approx(1000.0, rel=0.01)


async def test_discovery_answers_reach_only_a_discovered_pool(parts: Parts) -> None:
    static = PoolConfig.model_validate({"name": "p", "models": ["m"], "replicas": [U1]})
    found = PoolConfig.model_validate(
        {"name": "d", "models": ["m"], "discovery": {"name": "x.test", "port": 1}}
    )
    await parts.fleet.set_pools([static, found])
    assert set(parts.registry.replicas) == {N1}
    assert not (await parts.fleet.discovered("p", [U3])).added, "p lists its replicas"
    changes = await parts.fleet.discovered("d", [U1, U2])
    assert changes.added == [N2], "U1 stays in pool p"
    assert parts.registry.replicas[N1].pool.name == "p"
    assert (await parts.fleet.discovered("d", [])).removed == [N2]
    assert not (await parts.fleet.discovered("gone", [U3])).added
    assert parts.registry.known_models() == {"m"}  # a pool without replicas still names it
