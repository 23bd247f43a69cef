"""What one running gateway owns: built in the app's lifespan, read by the handlers."""

from __future__ import annotations

import logging
from typing import Any

import httpx
from fastapi import Request

from gateway.config import GatewayConfig
from gateway.errors import ApiError
from gateway.metrics import Metrics
from gateway.planner import Planner
from gateway.prewarm import Prewarmer
from gateway.proxy import Proxy
from gateway.registry import HealthChecker, Registry, Replica
from gateway.reuse import ReuseCounter
from gateway.scraper import Scraper
from gateway.tenants import CLASS_HEADER, Tenant, TenantStore
from routing.index import Index, MemoryIndex
from routing.types import Location, TenantClass, Tier

log = logging.getLogger("cachelane.state")


def build_index(config: GatewayConfig, registry: Registry) -> Index:
    """The configured index, bounded by each location's capacity (HBM spills to the CPU tier)."""
    block = config.routing.block_size_tokens
    pools = {name: r.pool for name, r in registry.replicas.items()}
    remote_caps = {t.name: t.capacity_tokens // block for t in config.remote_tiers}

    def capacity_blocks(loc: Location) -> int | None:
        if loc.tier is Tier.REMOTE:
            return remote_caps.get(loc.holder)
        pool = pools.get(loc.holder)
        if pool is None:
            return None
        tokens = pool.hbm_capacity_tokens if loc.tier is Tier.HBM else pool.cpu_capacity_tokens
        return tokens // block

    def spill_to(loc: Location) -> Location | None:
        pool = pools.get(loc.holder)
        if loc.tier is Tier.HBM and pool is not None and pool.cpu_capacity_tokens:
            return Location(loc.holder, Tier.CPU)
        return None

    if config.index.backend == "redis":
        from routing.index_redis import RedisIndex

        return RedisIndex.from_url(
            config.index.redis_url,
            cluster=config.index.redis_cluster,
            ttl_s=config.index.ttl_s,
            capacity_blocks=capacity_blocks,
            spill_to=spill_to,
        )
    return MemoryIndex(ttl_s=config.index.ttl_s, capacity_blocks=capacity_blocks, spill_to=spill_to)


def shared_redis(config: GatewayConfig) -> Any | None:
    """A Redis client for tenants and reuse counts when the index lives in Redis."""
    if config.index.backend != "redis":
        return None
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

    timeout_s = 0.25  # as the index's: a slow Redis must not hold requests up
    if config.index.redis_cluster:
        return RedisCluster.from_url(
            config.index.redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
    return Redis.from_url(
        config.index.redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
    )


class Gateway:
    """Everything one running gateway owns; created in the lifespan, read by the handlers."""

    def __init__(self, config: GatewayConfig, client: httpx.AsyncClient) -> None:
        self.config = config
        self.metrics = Metrics()
        self.registry = Registry(config, on_change=self._replica_changed)
        self.index = build_index(config, self.registry)
        self.redis = shared_redis(config)
        self.tenants = TenantStore(config.tenants, self.redis)
        self.reuse = ReuseCounter(self.metrics, redis=self.redis)
        self.planner = Planner(config, self.registry, self.index, self.reuse, self.metrics)
        self.proxy = Proxy(
            client, self.registry, self.planner, self.metrics, retries=config.upstream.retries
        )
        self.health = HealthChecker(
            self.registry,
            client,
            interval_s=config.health.interval_s,
            timeout_s=config.health.timeout_s,
        )
        self.prewarmer = Prewarmer(
            config.prewarm,
            client,
            self.registry,
            self.index,
            self.metrics,
            block_size_tokens=config.routing.block_size_tokens,
        )
        em = config.engine_metrics
        self.scraper = Scraper(
            client,
            self.registry.replicas.values(),
            interval_s=em.interval_s,
            timeout_s=em.timeout_s,
            stale_after_s=em.stale_after_s,
        )

    async def _replica_changed(self, replica: Replica, healthy: bool) -> None:
        self.metrics.replica_healthy.labels(replica.name).set(1 if healthy else 0)
        if not healthy:
            # Its cache may be gone (restart) or unreachable; stale entries would route to it.
            try:
                await self.index.drop_replica(replica.name)
            except Exception as err:
                self.metrics.index_errors.labels("drop_replica").inc()
                log.warning("could not drop %s from the index: %r", replica.name, err)

    def authenticate(self, request: Request) -> Tenant:
        """The request's tenant, served at the class it asks for (lower only)."""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        tenant = self.tenants.authenticate(key.strip() if scheme.lower() == "bearer" else None)
        if tenant is None:
            raise ApiError(
                401,
                "invalid or missing API key; send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        asked = request.headers.get(CLASS_HEADER)
        if asked is None:
            return tenant
        try:
            lowered = tenant.lowered_to(TenantClass(asked))
        except ValueError:
            lowered = None
        if lowered is None:
            raise ApiError(
                403,
                f"{CLASS_HEADER}: {asked!r} is not a class this tenant may use; a request may "
                f"ask for a lower class than {tenant.tenant_class.value!r}, never a higher one",
                code="class_not_allowed",
            )
        return lowered

    async def close(self) -> None:
        await self.index.close()
        if self.redis is not None:
            await self.redis.aclose()
