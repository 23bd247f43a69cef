"""What one running gateway owns: built in the app's lifespan, read by the handlers."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import Request
from prometheus_client import generate_latest

from gateway.body_fields import denied_fields
from gateway.calibration import CostLearner
from gateway.capture import Capture
from gateway.capture import header as capture_header
from gateway.config import GatewayConfig
from gateway.cost_store import CostStore, WorkerCosts
from gateway.costs import CostAccounting
from gateway.discovery import Discovery
from gateway.errors import ApiError
from gateway.fit_store import FitStore
from gateway.fleet import Fleet
from gateway.flow import ClassLimits, FlowControl, Shed
from gateway.index.resilient import ErrorHook, ResilientIndex
from gateway.keys import Keyring
from gateway.lease import Lease
from gateway.limits import RateLimiter
from gateway.metrics import Metrics
from gateway.planner import Plan, Planner
from gateway.prewarm import Prewarmer
from gateway.proxy import Proxy
from gateway.registry import HealthChecker, Registry, Replica
from gateway.reload import Reloader
from gateway.reuse import ReuseCounter
from gateway.scraper import Scraper
from gateway.settlement import observers
from gateway.siblings import Siblings
from gateway.tenant_store import TenantStore
from gateway.tenants import CLASS_HEADER, Tenant
from gateway.tracing import note_queue_wait
from gateway.upstream import Upstream
from routing.cost import CostTerms
from routing.index import Index, MemoryIndex, RemovedFn, ignore_removed
from routing.speculative import SpeculativeIndex
from routing.types import Location, TenantClass, Tier

if TYPE_CHECKING:  # precise mode only: pyzmq and msgpack are the [precise] extra
    from gateway.engines.feed import KvEvents

log = logging.getLogger("cachelane.state")

PRECISE_CAPACITY_SLACK = 2  # precise mode: index capacity = twice what the replica can hold

# A request ready to send: its plan and the lease on its first choice, reserved in the step that
# decided it (None: no healthy replica); whoever holds the lease releases it (gateway/lease.py).
Dispatch = tuple[Plan, Lease | None]


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
    replicas = registry.replicas  # read at each call: replicas join and leave (gateway/fleet.py)
    remote_caps = {t.name: t.capacity_tokens // block for t in config.remote_tiers}

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


def _depth_of(flow: FlowControl, klass: str) -> float:
    return float(flow.waiting()[klass])


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

    def __init__(
        self,
        config: GatewayConfig,
        client: httpx.AsyncClient,
        upstream: Upstream,
        *,
        config_path: str | None = None,
    ) -> None:
        """`client` serves health checks, scrapes and warms; `upstream` the proxied requests;
        `config_path`: the file `config` came from, which a reload reads again."""
        self.config = config
        self.metrics = Metrics()
        self.registry = Registry(config, on_change=self._replica_changed)
        self.costs = CostAccounting(config, self.registry, self.metrics)
        self.index = build_index(
            config, self.registry, on_error=self._index_failed, on_removed=self.costs.index_removed
        )
        if isinstance(self.index, ResilientIndex):
            index = self.index
            self.metrics.index_degraded.set_function(lambda: float(index.degraded))
        self.kv_events: KvEvents | None = None
        # precise mode: routing also sees what was just sent, until the engines' events settle it
        self.speculative: SpeculativeIndex | None = None
        routing_index: Index = self.index
        # cachelane serve --workers N: the other workers hear of this one's records and load
        self.siblings = Siblings.from_env(self.registry, self.exposition)
        if self.siblings is not None:
            self.registry.load_listener = self.siblings
            if config.index.backend == "memory" and config.routing.mode != "precise":
                routing_index = self.siblings.share_index(self.index)  # precise: engine events
        if config.routing.mode == "precise":
            from gateway.engines.feed import KvEvents

            self.speculative = routing_index = SpeculativeIndex(self.index)
            replicas = [(r.name, r.url, r.pool) for r in self.registry.replicas.values()]
            self.kv_events = KvEvents(config, replicas, routing_index, self.metrics)
        self.redis = shared_redis(config)
        self.keyring = Keyring(config.auth.secret)
        admin = config.admin
        self.admin_digest = (
            self.keyring.digest_of_sha256(admin.api_key_sha256)
            if admin.api_key_sha256
            else self.keyring.digest(admin.api_key)
            if admin.api_key
            else None
        )
        self.tenants = TenantStore(
            config.tenants,
            self.keyring,
            open_mode=config.auth.mode == "open",
            redis=self.redis,
            reserved_digests=[self.admin_digest] if self.admin_digest else [],
            on_rejected=lambda reason: self.metrics.tenant_records_rejected.labels(reason).inc(),
            on_refresh=self._tenant_refresh,
        )
        self.metrics.tenants_loaded.set(1 if self.tenants.loaded else 0)
        if not self.tenants.open_mode and not (config.tenants or admin.configured or self.redis):
            log.warning(
                "auth.mode is keys but no tenant or admin key is configured: every request "
                "will be refused (401). Set auth.mode: open to serve without keys."
            )
        for pool in config.pools:
            if not pool.cache_salt and not self.tenants.open_mode:
                log.warning(
                    "pool %s has cache_salt: false: its engines share cached prefixes across "
                    "tenants (docs/security.md, Isolation between tenants)",
                    pool.name,
                )
        exposure = config.exposure
        self.monitoring_digest = (  # reads /metrics and /ready when they need a key
            self.keyring.digest_of_sha256(exposure.api_key_sha256)
            if exposure.api_key_sha256
            else self.keyring.digest(exposure.api_key)
            if exposure.api_key
            else None
        )
        self.limits = RateLimiter(config.rate_limits, self.metrics, redis=self.redis)
        self.denied_fields = denied_fields(config.body_fields)
        self.reuse = ReuseCounter(self.metrics, redis=self.redis)
        self.planner = Planner(
            config, self.registry, routing_index, self.reuse, self.metrics, self.speculative
        )
        self.flow: FlowControl | None = None
        if config.flow_control.enabled:
            classes = config.classes
            self.flow = FlowControl(
                {
                    klass: ClassLimits(c.max_queue, c.max_wait_s)
                    for klass in TenantClass
                    for c in (getattr(classes, klass.value),)
                }
            )
            flow = self.flow
            self.registry.on_load_change = flow.kick
            for klass in TenantClass:
                self.metrics.flow_waiting.labels(klass.value).set_function(
                    functools.partial(_depth_of, flow, klass.value)
                )
        self.learner = CostLearner(
            config.routing.calibration, self.registry.replicas.values(), self.metrics
        )
        self.fit_store = (
            FitStore(self.redis, self.learner)
            if self.redis is not None and config.routing.calibration == "fit"
            else None
        )
        # the cost accounting shared through Redis, for `cachelane report --redis`
        self.cost_store = CostStore(self.redis, self.costs) if self.redis is not None else None
        self.worker_costs: WorkerCosts | None = None
        if self.siblings is not None:  # --workers N: /debug/costs answers for every worker
            self.worker_costs = WorkerCosts(self.siblings.directory, self.costs)
            if config.index.backend == "memory" or config.routing.mode == "precise":
                # every worker's index sees every eviction: one counts them
                self.costs.counts_evictions = self.worker_costs.leads
        self.capture: Capture | None = None
        if config.capture.path is not None:
            self.capture = Capture(
                config.capture,
                functools.partial(capture_header, config, self.registry),
                self.metrics,
                self._terms_in_use,
            )
        # what happens after an answer: the one list of post-response observers
        settlement = observers(
            self.planner,
            self.metrics,
            self.learner,
            costs=self.costs,
            capture=self.capture,
            limits=self.limits if self.limits.enabled else None,  # tokens/min: usage corrects
        )
        self.proxy = Proxy(
            upstream, self.registry, self.metrics, settlement, retries=config.upstream.retries
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
            block_size_tokens=config.routing.block_size_tokens,
        )
        self.fleet = Fleet(
            config.pools,
            self.registry,
            self.learner,
            routing_index,
            self.metrics,
            self.health,
            self.kv_events,
            drain_timeout_s=config.upstream.read_timeout_s,
        )
        self.discovery = Discovery(self.fleet, self.metrics)
        self.reloader = Reloader(self, config_path)

    def dispatch(self, plan: Plan) -> Dispatch:
        """The plan and its first choice, reserved in this very step (Proxy.reserve_first)."""
        return plan, self.proxy.reserve_first(plan)

    def dispatch_now(self, plan: Plan) -> Dispatch | None:
        """Dispatch without an await between the decision and its reservation when flow control
        lets the request go at once (its class has no budget, or it fits the budget with no one
        of its class or above waiting); None when it must wait (hold)."""
        held = self._flow_for(plan)
        if held is None:
            return self.dispatch(plan)
        flow, ready = held
        klass = plan.tenant.tenant_class
        if not flow.admit_now(klass, ready):
            return None
        self.metrics.flow_wait_seconds.labels(klass.value).observe(0.0)
        note_queue_wait(0.0)
        return self.dispatch(plan)

    async def hold(self, plan: Plan) -> Dispatch:
        """Flow control: wait, in the class's queue, until the request fits its class's TTFT
        budget somewhere (critical first, then standard, then batch; round robin between
        tenants); then decide again on the load of now and dispatch in the same step. Raises 503
        with Retry-After when the queue is full or the wait passed the class's maximum."""
        held = self._flow_for(plan)
        if held is None:
            return self.dispatch(plan)
        flow, ready = held
        klass = plan.tenant.tenant_class
        try:
            waited_s = await flow.admit(plan.tenant.name, klass, ready)
        except Shed as err:
            self.metrics.flow_shed.labels(klass.value, err.reason).inc()
            raise ApiError(
                503,
                f"the fleet is saturated and this {klass.value} request "
                + (
                    "found its class's queue full"
                    if err.reason == "queue_full"
                    else "waited its class's maximum"
                )
                + "; retry later",
                code="overloaded",
                type="server_error",
                headers={"retry-after": str(err.retry_after_s)},
            ) from None
        self.metrics.flow_wait_seconds.labels(klass.value).observe(waited_s)
        note_queue_wait(waited_s)
        try:
            return self.dispatch(self.planner.replan(plan))
        except BaseException:
            flow.kick()  # it will not reserve: let the next one go
            raise

    def _flow_for(self, plan: Plan) -> tuple[FlowControl, Callable[[], bool]] | None:
        """Flow control and the request's ready() predicate, or None when its class is never
        held (no TTFT budget, or flow control off)."""
        klass = plan.tenant.tenant_class
        budget_ms = getattr(self.config.classes, klass.value).ttft_budget_ms
        if self.flow is None or budget_ms is None:
            return None
        flow, budget_s = self.flow, budget_ms / 1000

        def ready() -> bool:
            return not flow.higher_class_waiting(klass) and self.planner.within_budget(
                plan, budget_s
            )

        return flow, ready

    def _index_failed(self, op: str, err: BaseException) -> None:
        self.metrics.index_errors.labels(op).inc()
        log.warning("shared index %s failed, serving on the local view: %r", op, err)

    def loads(self) -> dict[str, dict[str, int]]:
        """Each replica's load as routing sees it now: own counts, raised to a fresh scrape of the
        engine's metrics (which include what other gateways sent)."""
        now_s, stale_s = time.monotonic(), self.config.engine_metrics.stale_after_s
        return {name: asdict(r.load(now_s, stale_s)) for name, r in self.registry.replicas.items()}

    def exposition(self) -> bytes:
        """This process's /metrics text."""
        for r in self.registry.replicas.values():
            self.metrics.replica_in_flight.labels(r.name).set(r.in_flight)
        return generate_latest(self.metrics.registry)

    def index_status(self) -> dict[str, Any]:
        """For /ready: a degraded index still serves (on the local view), so it is not fatal."""
        status: dict[str, Any] = {"backend": self.config.index.backend, "ok": True}
        if isinstance(self.index, ResilientIndex):
            status["ok"] = not self.index.degraded
            status["degraded_since"] = self.index.since
        return status

    async def _replica_changed(self, replica: Replica, healthy: bool) -> None:
        self.metrics.replica_healthy.labels(replica.name).set(1 if healthy else 0)
        if not healthy:
            reason = replica.ejection_reason or "health_check"
            self.metrics.ejections.labels(replica.name, reason).inc()
            if self.kv_events is not None and replica.name in self.kv_events.feeds:
                self.kv_events.feeds[replica.name].replica_down()
            # Its cache may be gone (restart) or unreachable; stale entries would route to it.
            try:
                if self.speculative is not None:
                    await self.speculative.drop_replica(replica.name)
                else:
                    await self.index.drop_replica(replica.name)
            except Exception as err:
                self.metrics.index_errors.labels("drop_replica").inc()
                log.warning("could not drop %s from the index: %r", replica.name, err)

    def _tenant_refresh(self, error_kind: str | None) -> None:
        if error_kind is None:
            self.metrics.tenants_loaded.set(1)
        else:
            self.metrics.tenant_refresh_errors.labels(error_kind).inc()

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
        return served_at_asked_class(tenant, request)

    def _terms_in_use(self) -> dict[str, tuple[str, CostTerms]]:
        """Replica -> (its pool, the cost terms routing uses for it): the traffic capture's
        fit lines."""
        return {
            name: (r.pool.name, self.learner.terms_of(name))
            for name, r in self.registry.replicas.items()
        }

    async def close(self) -> None:
        await self.limits.close()
        if self.capture is not None:
            await asyncio.to_thread(self.capture.close)  # flushes the file off the event loop
        await self.discovery.aclose()
        await self.fleet.aclose()
        if self.kv_events is not None:
            await self.kv_events.aclose()
        await self.index.close()
        if self.siblings is not None:
            self.siblings.close()
        if self.redis is not None:
            await self.redis.aclose()


def served_at_asked_class(tenant: Tenant, request: Request) -> Tenant:
    """The tenant served at the class the request asks for (x-cachelane-class: lower only)."""
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
