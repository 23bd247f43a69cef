"""Replicas joining and leaving a running gateway, as discovery finds them or a reload lists them.

The one place a membership change reaches everything that knows the replicas: the registry (what
routing sees), the cost learner, the KV-event feeds, the health checker, the metrics and the
index.

A replica that leaves takes no new request at once (it counts as unhealthy and no health check
re-admits it); the requests in flight on it finish (draining), then the rest of what it had is let
go (its learned costs, its gauges). Its index entries are dropped when it leaves, and once more
when it has drained: a request that was being sent meanwhile may have recorded its prompt. A
replica that comes back while still draining is taken back as it was, its load counts intact.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.accounting.calibration import CostLearner
from gateway.config import PoolConfig
from gateway.fleet.health_checks import HealthChecker
from gateway.fleet.registry import Registry, replica_name
from gateway.fleet.replica import Replica
from gateway.telemetry.metrics import Metrics
from routing.index import Index
from routing.learn import TERMS

if TYPE_CHECKING:
    from gateway.engines.feed import KvEvents

log = logging.getLogger("cachelane.fleet")

DRAIN_POLL_S = 0.2  # how often a leaving replica's requests in flight are counted


@dataclass
class Changes:
    """What one membership change did, by replica name."""

    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)  # stayed, with a changed pool config


Wanted = Mapping[str, tuple[str, PoolConfig]]  # replica name -> (its URL, its pool)


class Fleet:
    def __init__(
        self,
        pools: Sequence[PoolConfig],
        registry: Registry,
        learner: CostLearner,
        index: Index,
        metrics: Metrics,
        health: HealthChecker,
        kv_events: KvEvents | None,
        *,
        drain_timeout_s: float,
    ) -> None:
        """`index`: the one routing reads (precise mode: the speculative one over the index);
        `drain_timeout_s`: the longest a leaving replica's requests are waited for."""
        self.pools = {p.name: p for p in pools}
        self._registry = registry
        self._learner = learner
        self._index = index
        self._metrics = metrics
        self._health = health
        self._feeds = kv_events  # precise mode only
        self._drain_timeout_s = drain_timeout_s
        self._draining: dict[str, tuple[Replica, asyncio.Task[None]]] = {}
        self._lock = asyncio.Lock()  # discovery and reloads take turns
        self._conflicts: set[tuple[str, str]] = set()  # (replica, pool) said once

    @property
    def draining(self) -> set[str]:
        """Replicas that left and still have requests in flight."""
        return set(self._draining)

    async def set_pools(self, pools: Sequence[PoolConfig]) -> Changes:
        """The fleet a (reloaded) config describes: a static pool's replicas as listed; a
        discovered pool keeps what it has until its name is resolved again; the replicas of a
        pool no longer configured leave."""
        async with self._lock:
            self.pools = {p.name: p for p in pools}
            self._registry.pool_models = frozenset(m for p in pools for m in p.models)
            wanted: dict[str, tuple[str, PoolConfig]] = {}
            for pool in pools:
                for raw in pool.replicas:
                    url = str(raw).rstrip("/")
                    wanted[replica_name(url)] = (url, pool)
            for r in self._registry.replicas.values():
                found = self.pools.get(r.pool.name)
                if found is not None and found.discovery is not None and r.name not in wanted:
                    wanted[r.name] = (r.url, found)
            return await self._apply(wanted, in_scope=lambda _: True)

    async def discovered(self, pool_name: str, urls: Iterable[str]) -> Changes:
        """A discovered pool's replicas are now `urls` (base URLs). A replica that another pool
        already has is left there (said once)."""
        async with self._lock:
            pool = self.pools.get(pool_name)
            if pool is None or pool.discovery is None:  # reloaded away meanwhile
                return Changes()
            wanted: dict[str, tuple[str, PoolConfig]] = {}
            for url in urls:
                name = replica_name(url)
                other = self._registry.replicas.get(name)
                if other is not None and other.pool.name != pool_name:
                    if (name, pool_name) not in self._conflicts:
                        self._conflicts.add((name, pool_name))
                        log.warning(
                            "replica %s found for pool %r is in pool %r already: left there",
                            name,
                            pool_name,
                            other.pool.name,
                        )
                    continue
                wanted[name] = (url, pool)
            return await self._apply(wanted, in_scope=lambda r: r.pool.name == pool_name)

    async def _apply(self, wanted: Wanted, in_scope: Callable[[Replica], bool]) -> Changes:
        changes = Changes()
        for name in [n for n, r in self._registry.replicas.items() if in_scope(r)]:
            if name not in wanted:
                await self._remove(name)
                changes.removed.append(name)
        joined: list[Replica] = []
        for name, (url, pool) in wanted.items():
            replica = self._registry.replicas.get(name)
            if replica is None:
                joined.append(self._add(url, pool))
                changes.added.append(name)
            elif replica.pool != pool:
                self._move(replica, pool)
                changes.moved.append(name)
        if joined:  # admitted as soon as they answer, not at the next round of checks
            await self._health.check(joined)
        return changes

    def _add(self, url: str, pool: PoolConfig) -> Replica:
        name = replica_name(url)
        draining = self._draining.pop(name, None)
        if draining is not None:
            replica, task = draining
            task.cancel()
            self._registry.readmit(replica)
            if replica.pool != pool:
                self._move(replica, pool)
        else:
            replica = self._registry.add(url, pool)
            self._learner.add(replica)
        self._metrics.replica_healthy.labels(name).set(0)
        if self._feeds is not None:
            self._feeds.add(name, replica.url, replica.pool)
        self._metrics.replica_changes.labels(pool.name, "added").inc()
        log.info("replica %s joined pool %r", name, pool.name)
        return replica

    def _move(self, replica: Replica, pool: PoolConfig) -> None:
        before = replica.pool
        self._registry.move(replica, pool)
        if before.costs != pool.costs:
            self._learner.add(replica)  # learning starts again from the new seed
        if self._feeds is not None and before.kv_events != pool.kv_events:
            self._feeds.remove(replica.name)
            self._feeds.add(replica.name, replica.url, pool)
        log.info("replica %s: pool %r reconfigured", replica.name, pool.name)

    async def _remove(self, name: str) -> None:
        replica = self._registry.remove(name)
        if replica is None:
            return
        if self._feeds is not None:
            self._feeds.remove(name)
        self._metrics.replica_healthy.labels(name).set(0)
        self._metrics.replica_changes.labels(replica.pool.name, "removed").inc()
        log.info(
            "replica %s left pool %r (%d requests in flight finish there)",
            name,
            replica.pool.name,
            replica.in_flight,
        )
        await self._drop_entries(name)
        task = asyncio.create_task(self._drain(replica), name=f"drain {name}")
        self._draining[name] = (replica, task)

    async def _drain(self, replica: Replica) -> None:
        """Wait for the requests in flight on a replica that left, then let go of it."""
        name = replica.name
        try:
            async with asyncio.timeout(self._drain_timeout_s):
                # a poll: in_flight is counted down by Reservation.release, which signals nothing
                while replica.in_flight > 0:  # noqa: ASYNC110
                    await asyncio.sleep(DRAIN_POLL_S)
        except TimeoutError:
            log.warning(
                "replica %s: %d requests still in flight %.0f s after it left",
                name,
                replica.in_flight,
                self._drain_timeout_s,
            )
        # from here on it cannot be taken back: it is gone from _draining at once
        del self._draining[name]
        self._learner.remove(name)
        self._metrics.forget_replica(name, TERMS)
        await self._drop_entries(name)

    async def _drop_entries(self, name: str) -> None:
        try:
            await self._index.drop_replica(name)
        except Exception as err:  # the index may be away; its entries expire (ttl_s)
            self._metrics.index_errors.labels("drop_replica").inc()
            log.warning("could not drop %s from the index: %r", name, err)

    async def aclose(self) -> None:
        """Stop draining (the gateway is shutting down)."""
        tasks = [task for _, task in self._draining.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
