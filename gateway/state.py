"""What one running gateway holds: its parts, built by gateway/wiring.py `build_gateway`, read by
the handlers (gateway/serving/handling.py, gateway/http/serve.py). Request logic lives in
handling.py."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import generate_latest

from gateway.accounting.calibration import CostLearner
from gateway.accounting.capture import Capture
from gateway.accounting.fit_store import FitStore
from gateway.accounting.ledger import CostAccounting
from gateway.accounting.ledger_store import CostStore, WorkerCosts
from gateway.components import Component
from gateway.config import GatewayConfig
from gateway.config.pools import RemoteTierConfig
from gateway.fleet.discovery import Discovery
from gateway.fleet.health_checks import HealthChecker
from gateway.fleet.membership import Fleet
from gateway.fleet.registry import Registry
from gateway.fleet.scraper import Scraper
from gateway.fleet.siblings import Siblings
from gateway.index.resilient import ErrorHook, ResilientIndex
from gateway.index.reuse import ReuseCounter
from gateway.serving.flow import FlowControl
from gateway.serving.planner import Planner
from gateway.serving.prewarm import Prewarmer
from gateway.serving.proxy import Proxy
from gateway.telemetry.metrics import Metrics
from gateway.tenancy.keys import Keyring
from gateway.tenancy.rate_limits import RateLimiter
from gateway.tenancy.store import TenantStore
from routing.hidden_tier import ANY_HOLDER
from routing.index import Index, MemoryIndex, RemovedFn, ignore_removed
from routing.speculative import SpeculativeIndex
from routing.types import Location, TenantClass, Tier

if TYPE_CHECKING:
    from gateway.engines.feed import KvEvents
    from gateway.fleet.reload import Reloader
    from gateway.serving.responses import (
        ResponseOwners,  # precise mode only: pyzmq and msgpack are the [precise] extra
    )


PRECISE_CAPACITY_SLACK = 2  # precise mode: index capacity = twice what the replica can hold
REDIS_TIMEOUT_S = 0.25  # as the index's: a slow Redis must not hold requests up


@dataclass(eq=False)
class Gateway:
    """Everything one running gateway owns. `components` is its one ordered list of long-lived
    parts, started in order and closed in reverse by the app's lifespan (gateway/components.py);
    `config` is replaced by a reload (gateway/fleet/reload.py)."""

    config: GatewayConfig
    metrics: Metrics
    registry: Registry
    index: Index  # what this gateway records; routing may read it through `speculative`
    planner: Planner
    proxy: Proxy
    keyring: Keyring
    admin_digest: str | None
    monitoring_digest: str | None  # reads /metrics and /ready when they need a key
    tenants: TenantStore
    limits: RateLimiter
    denied_fields: dict[TenantClass, tuple[str, ...]]  # per class (gateway/http/body_fields.py)
    reuse: ReuseCounter
    costs: CostAccounting
    learner: CostLearner
    health: HealthChecker
    prewarmer: Prewarmer
    scraper: Scraper
    fleet: Fleet
    discovery: Discovery
    responses: ResponseOwners  # which replica stored a response (the Responses API)
    redis: Any | None = None  # tenants, reuse counts, costs and fits when the index is in Redis
    flow: FlowControl | None = None
    siblings: Siblings | None = None  # cachelane serve --workers N
    kv_events: KvEvents | None = None  # precise mode
    speculative: SpeculativeIndex | None = None  # what was just sent, not yet recorded
    fit_store: FitStore | None = None
    cost_store: CostStore | None = None
    worker_costs: WorkerCosts | None = None
    capture: Capture | None = None
    reloader: Reloader = field(init=False)  # it reads the gateway: set once the gateway is built
    components: list[Component] = field(default_factory=list)

    def loads(self) -> dict[str, dict[str, Any]]:
        """Each replica's load as routing sees it now: own counts, raised to a fresh scrape of the
        engine's metrics (which include what other gateways sent)."""
        now_s, stale_s = time.monotonic(), self.config.engine_metrics.stale_after_s
        out = {}
        for name, r in self.registry.replicas.items():
            load = r.load(now_s, stale_s)
            out[name] = asdict(load) | {"queue": [q._asdict() for q in load.queue]}
        return out

    def exposition(self) -> bytes:
        """This process's /metrics text."""
        return exposition(self.metrics, self.registry)

    def index_status(self) -> dict[str, Any]:
        """For /ready: a degraded index still serves (on the local view), so it is not fatal."""
        status: dict[str, Any] = {"backend": self.config.index.backend, "ok": True}
        if isinstance(self.index, ResilientIndex):
            status["ok"] = not self.index.degraded
            status["degraded_since"] = self.index.since
        return status


def exposition(metrics: Metrics, registry: Registry) -> bytes:
    """A process's /metrics text, its replicas' in-flight counts read now."""
    for r in registry.replicas.values():
        metrics.replica_in_flight.labels(r.name).set(r.in_flight)
    return generate_latest(metrics.registry)


def build_index(
    config: GatewayConfig,
    registry: Registry,
    *,
    on_error: ErrorHook | None = None,
    on_removed: RemovedFn = ignore_removed,
) -> Index:
    """The configured index, bounded by each location's capacity (HBM spills to the CPU tier).

    A Redis index is backed by a local one (ResilientIndex): if Redis goes away the gateway
    routes on its own view, and `on_error(op, error)` hears of every failed Redis call."""
    block = config.routing.block_size_tokens
    replicas = (
        registry.replicas
    )  # read at each call: replicas join and leave (gateway/fleet/membership.py)
    remote_caps = {t.name: t.capacity_tokens // block for t in config.remote_tiers}
    # a tier nobody named (routing/hidden_tier.py): a configured tier's default capacity
    remote_caps[ANY_HOLDER] = RemoteTierConfig.model_fields["capacity_tokens"].default // block

    def capacity_blocks(loc: Location) -> int | None:
        if loc.tier is Tier.REMOTE:
            return remote_caps.get(loc.holder)
        replica = replicas.get(loc.holder)
        if replica is None:
            return None
        if loc.tier is Tier.HBM:
            tokens = replica.hbm_capacity_tokens()  # may come from the engine
        else:
            tokens = replica.pool.cpu_capacity_tokens
        if config.routing.mode == "precise":
            # The engines' BlockRemoved events do the evicting; the bound only caps what missed
            # removals could leave behind, so it must never bind before the engine's own LRU.
            return tokens // block * PRECISE_CAPACITY_SLACK
        return tokens // block

    def spill_to(loc: Location) -> Location | None:
        if config.routing.mode == "precise":
            return None  # the engines' events say what reaches the CPU tier (medium CPU)
        replica = replicas.get(loc.holder)
        pool = replica.pool if replica is not None else None
        if loc.tier is Tier.HBM and pool is not None and pool.cpu_capacity_tokens:
            return Location(loc.holder, Tier.CPU)
        return None

    local = MemoryIndex(
        ttl_s=config.index.ttl_s,
        capacity_blocks=capacity_blocks,
        spill_to=spill_to,
        on_removed=on_removed,  # the local view: this gateway's records, or the engines' events
    )
    if config.index.backend == "redis":
        from gateway.index.redis_backend import RedisIndex

        shared = RedisIndex.from_url(
            config.index.redis_url,
            cluster=config.index.redis_cluster,
            ttl_s=config.index.ttl_s,
            capacity_blocks=capacity_blocks,
            spill_to=spill_to,
        )
        return ResilientIndex(shared, local, on_error=on_error or (lambda _op, _err: None))
    return local


def shared_redis(config: GatewayConfig) -> Any | None:
    """A Redis client for tenants and reuse counts when the index lives in Redis."""
    if config.index.backend != "redis":
        return None
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

    url, timeout_s = config.index.redis_url, REDIS_TIMEOUT_S
    if config.index.redis_cluster:
        return RedisCluster.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
    return Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
