"""Wiring: the one place a running gateway's parts are built (`build_gateway`) and listed, in the
order they start (`components`). Adding a background part is one line in `components`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import httpx

from gateway.accounting.calibration import CostLearner
from gateway.accounting.capture import Capture
from gateway.accounting.capture import header as capture_header
from gateway.accounting.fit_store import FitStore
from gateway.accounting.ledger import CostAccounting
from gateway.accounting.ledger_store import CostStore, WorkerCosts
from gateway.components import Background, Component, Resource, loop
from gateway.config import GatewayConfig, no_tenant_warning
from gateway.fleet.discovery import Discovery
from gateway.fleet.health_checks import HealthChecker
from gateway.fleet.membership import Fleet
from gateway.fleet.registry import Registry
from gateway.fleet.reload import Reloader, install_sighup
from gateway.fleet.replica import Replica
from gateway.fleet.scraper import Scraper
from gateway.fleet.siblings import Siblings
from gateway.http.body_fields import denied_fields
from gateway.index.resilient import ResilientIndex
from gateway.index.reuse import ReuseCounter
from gateway.serving.flow import ClassLimits, FlowControl
from gateway.serving.planner import Planner
from gateway.serving.prewarm import Prewarmer
from gateway.serving.proxy import Proxy
from gateway.serving.responses import ResponseOwners
from gateway.serving.settlement import observers
from gateway.serving.upstream import AiohttpUpstream, Upstream
from gateway.state import Gateway, build_index, exposition, shared_redis
from gateway.telemetry.metrics import Metrics
from gateway.tenancy.keys import Keyring
from gateway.tenancy.rate_limits import RateLimiter
from gateway.tenancy.store import TenantStore
from routing.cost import CostTerms
from routing.index import Index
from routing.speculative import SpeculativeIndex
from routing.types import TenantClass

if TYPE_CHECKING:  # precise mode only: pyzmq and msgpack are the [precise] extra
    from gateway.engines.feed import KvEvents

log = logging.getLogger("cachelane.wiring")

KEEPALIVE_S = 60.0  # idle replica connections kept a minute (gateway/serving/upstream.py: why)


def components(
    gw: Gateway,
    client: httpx.AsyncClient | None,
    upstream: Upstream | None,
    config_path: str | None,
) -> list[Component]:
    """The gateway's long-lived parts in the order they start (they close in reverse); a part
    absent from this configuration is left out. `client` and `upstream`: closed when owned."""
    config, redis, fits = gw.config, gw.redis, gw.fit_store
    parts: list[Component | None] = [
        Resource("http-client", closed=client.aclose) if client is not None else None,
        Resource("upstream", closed=upstream.aclose) if upstream is not None else None,
        Resource("redis", closed=redis.aclose) if redis is not None else None,
        Resource("index", closed=gw.index.close),
        Resource("responses", closed=gw.responses.aclose),  # its pending Redis writes
        Resource("rate-limits", closed=gw.limits.close),  # waits for its pending Redis writes
        _gc_pauses(gw.metrics),
        _capture(gw.capture) if gw.capture is not None else None,
        Resource("fleet", opened=partial(_replicas_unhealthy, gw), closed=gw.fleet.aclose),
        Resource("discovery", opened=partial(_follow_pools, gw), closed=gw.discovery.aclose),
        loop("health-checks", gw.health.run, prepare=gw.health.check_all),
        _sighup(gw.reloader) if config_path else None,
        loop("tenant-refresh", gw.tenants.run, prepare=partial(_load_tenants, gw)),
        loop("prewarm", gw.prewarmer.run) if config.prewarm.enabled else None,
        _siblings(gw.siblings) if gw.siblings is not None else None,
        loop("cost-fit-sharing", fits.run, prepare=fits.load) if fits is not None else None,
        loop("cost-sharing", gw.cost_store.run) if gw.cost_store is not None else None,
        loop("worker-costs", gw.worker_costs.run) if gw.worker_costs is not None else None,
        loop("flow-control", gw.flow.run) if gw.flow is not None else None,
        loop("engine-metrics", gw.scraper.run) if config.engine_metrics.enabled else None,
        _kv_events(gw.kv_events) if gw.kv_events is not None else None,
    ]
    return [part for part in parts if part is not None]


def build_gateway(
    config: GatewayConfig,
    client: httpx.AsyncClient | None = None,
    upstream: Upstream | None = None,
    *,
    config_path: str | None = None,
) -> Gateway:
    """Every part of one gateway, and its component list. `client` serves health checks, scrapes
    and warms, `upstream` the proxied requests: made here (and closed by the gateway's
    components) when not given; `config_path`: the file `config` came from, read by a reload."""
    own_client: httpx.AsyncClient | None = None
    own_upstream: Upstream | None = None
    if client is None:  # trust_env=False: replica traffic never goes through an env proxy
        client = own_client = httpx.AsyncClient(**_client_limits(config), trust_env=False)
    if upstream is None:
        upstream = own_upstream = _upstream(config)
    gw = _parts(config, client, upstream)
    gw.reloader = Reloader(gw, config_path)
    gw.components = components(gw, own_client, own_upstream, config_path)
    return gw


@dataclass(frozen=True)
class _Routing:
    registry: Registry
    costs: CostAccounting
    index: Index  # what this gateway records
    # what routing reads: the index (shared with sibling workers) and what was just sent
    speculative: SpeculativeIndex
    kv_events: KvEvents | None
    siblings: Siblings | None


def _routing(config: GatewayConfig, metrics: Metrics) -> _Routing:
    """The replicas, the index and what feeds it (sibling workers, the engines' KV events)."""
    on_change = _ReplicaChanged(metrics)
    registry = Registry(config, on_change=on_change)
    costs = CostAccounting(config, registry, metrics)
    index = build_index(
        config,
        registry,
        on_error=partial(_index_failed, metrics),
        on_removed=costs.index_removed,
    )
    if isinstance(index, ResilientIndex):
        resilient = index
        metrics.index_degraded.set_function(lambda: float(resilient.degraded))
    # cachelane serve --workers N: the other workers hear of this one's records and load
    siblings = Siblings.from_env(registry, partial(exposition, metrics, registry))
    shared: Index = index
    if siblings is not None:
        registry.load_listener = siblings
        if config.index.backend == "memory" and config.routing.mode != "precise":
            shared = siblings.share_index(index)  # precise: the engines' events
    kv_events: KvEvents | None = None
    # routing also sees what was just sent, until the engines' events (precise mode) or the
    # gateway's own record (approximate mode: a KV load's blocks once it is done) settle it
    speculative = SpeculativeIndex(shared)
    if config.routing.mode == "precise":
        from gateway.engines.feed import KvEvents

        replicas = [(r.name, r.url, r.pool) for r in registry.replicas.values()]
        kv_events = KvEvents(config, replicas, speculative, metrics)
    on_change.index, on_change.speculative, on_change.kv_events = index, speculative, kv_events
    return _Routing(registry, costs, index, speculative, kv_events, siblings)


def _parts(config: GatewayConfig, client: httpx.AsyncClient, upstream: Upstream) -> Gateway:
    metrics = Metrics()
    r = _routing(config, metrics)
    redis = shared_redis(config)
    limits = RateLimiter(config.rate_limits, metrics, redis=redis)
    reuse = ReuseCounter(metrics, redis=redis)
    planner = Planner(config, r.registry, r.speculative, reuse, metrics, r.speculative)
    learner = CostLearner(config.routing.calibration, r.registry.replicas.values(), metrics)
    capture = _capture_of(config, r.registry, metrics, learner)
    settlement = observers(  # what happens after an answer: the one list of observers
        planner,
        metrics,
        learner,
        costs=r.costs,
        capture=capture,
        limits=limits if limits.enabled else None,  # tokens/min: usage corrects
    )
    health = HealthChecker(
        r.registry,
        client,
        interval_s=config.health.interval_s,
        timeout_s=config.health.timeout_s,
        on_probe=lambda replica, passed: metrics.count_probe(replica.name, passed),
    )
    fleet = Fleet(
        config.pools,
        r.registry,
        learner,
        r.speculative,
        metrics,
        health,
        r.kv_events,
        drain_timeout_s=config.upstream.read_timeout_s,
    )
    fit_store, cost_store, worker_costs = _sharing(config, redis, learner, r.costs, r.siblings)
    return Gateway(
        config=config,
        metrics=metrics,
        registry=r.registry,
        index=r.index,
        planner=planner,
        proxy=Proxy(upstream, r.registry, metrics, settlement, config.upstream),
        **_tenancy(config, metrics, redis),
        limits=limits,
        denied_fields=denied_fields(config.body_fields),
        reuse=reuse,
        costs=r.costs,
        learner=learner,
        health=health,
        prewarmer=_prewarmer(config, client, r.registry, r.index, metrics),
        scraper=_scraper(config, client, r.registry),
        fleet=fleet,
        discovery=Discovery(fleet, metrics),
        responses=ResponseOwners(r.registry, client, redis=redis),
        redis=redis,
        flow=_flow_control(config, r.registry, metrics),
        siblings=r.siblings,
        kv_events=r.kv_events,
        speculative=r.speculative,
        fit_store=fit_store,
        cost_store=cost_store,
        worker_costs=worker_costs,
        capture=capture,
    )


# --------------------------------------------------------------------------- the parts' builders


def _client_limits(config: GatewayConfig) -> dict[str, Any]:
    """The health, scrape and warm client's pool and timeouts."""
    up = config.upstream
    return {
        "limits": httpx.Limits(
            max_connections=up.max_connections,
            max_keepalive_connections=up.max_connections,
            keepalive_expiry=KEEPALIVE_S,
        ),
        "timeout": httpx.Timeout(
            connect=up.connect_timeout_s,
            read=up.read_timeout_s,
            write=30.0,  # a health check or warm body is small: 30 s only bounds a stuck peer
            pool=up.connect_timeout_s,
        ),
    }


def _upstream(config: GatewayConfig) -> Upstream:
    """The proxied requests' connections (gateway/serving/upstream.py: why aiohttp). Made inside the
    running event loop (the app's lifespan builds the gateway)."""
    up = config.upstream
    return AiohttpUpstream(
        max_connections_per_replica=up.max_connections,
        connect_timeout_s=up.connect_timeout_s,
        read_timeout_s=up.read_timeout_s,
        keepalive_s=KEEPALIVE_S,
    )


def _tenancy(config: GatewayConfig, metrics: Metrics, redis: Any | None) -> dict[str, Any]:
    """The keyring, the admin's and monitoring's key digests and the tenants (Gateway fields);
    warns of a configuration that would refuse every request or share cached prefixes."""
    keyring = Keyring(config.auth.secret)
    admin_digest = _digest(keyring, config.admin.api_key_sha256, config.admin.api_key)
    exposure = config.exposure
    tenants = TenantStore(
        config.tenants,
        keyring,
        open_mode=config.auth.mode == "open",
        redis=redis,
        reserved_digests=[admin_digest] if admin_digest else [],
        on_rejected=lambda reason: metrics.tenant_records_rejected.labels(reason).inc(),
        on_refresh=partial(_tenant_refreshed, metrics),
    )
    metrics.tenants_loaded.set(1 if tenants.loaded else 0)
    if not tenants.open_mode and not (config.tenants or config.admin.configured or redis):
        log.warning(
            "auth.mode is keys but no tenant or admin key is configured: every request "
            "will be refused (401). Set auth.mode: open to serve without keys."
        )
    for pool in config.pools:
        if not pool.cache_salt and not tenants.open_mode:
            log.warning(
                "pool %s has cache_salt: false: its engines share cached prefixes across "
                "tenants (docs/security.md, Isolation between tenants)",
                pool.name,
            )
    return {
        "keyring": keyring,
        "admin_digest": admin_digest,
        "monitoring_digest": _digest(keyring, exposure.api_key_sha256, exposure.api_key),
        "tenants": tenants,
    }


def _digest(keyring: Keyring, sha256: str | None, api_key: str | None) -> str | None:
    if sha256:
        return keyring.digest_of_sha256(sha256)
    return keyring.digest(api_key) if api_key else None


def _flow_control(
    config: GatewayConfig, registry: Registry, metrics: Metrics
) -> FlowControl | None:
    if not config.flow_control.enabled:
        return None
    classes = config.classes
    flow = FlowControl(
        {
            klass: ClassLimits(c.max_queue, c.max_wait_s)
            for klass in TenantClass
            for c in (getattr(classes, klass.value),)
        }
    )
    registry.on_load_change = flow.kick
    for klass in TenantClass:
        metrics.flow_waiting.labels(klass.value).set_function(partial(_depth_of, flow, klass.value))
    return flow


def _depth_of(flow: FlowControl, klass: str) -> float:
    return float(flow.waiting()[klass])


def _sharing(
    config: GatewayConfig,
    redis: Any | None,
    learner: CostLearner,
    costs: CostAccounting,
    siblings: Siblings | None,
) -> tuple[FitStore | None, CostStore | None, WorkerCosts | None]:
    """Cost fits and cost accounting shared through Redis (`cachelane report --redis`), and
    between the workers of `cachelane serve --workers N` (/debug/costs answers for every one)."""
    fit_store = (
        FitStore(redis, learner)
        if redis is not None and config.routing.calibration == "fit"
        else None
    )
    cost_store = CostStore(redis, costs) if redis is not None else None
    worker_costs = None
    if siblings is not None:
        worker_costs = WorkerCosts(siblings.directory, costs)
        if config.index.backend == "memory" or config.routing.mode == "precise":
            # every worker's index sees every eviction: one counts them
            costs.counts_evictions = worker_costs.leads
    return fit_store, cost_store, worker_costs


def _capture_of(
    config: GatewayConfig, registry: Registry, metrics: Metrics, learner: CostLearner
) -> Capture | None:
    if config.capture.path is None:
        return None

    def terms_in_use() -> dict[str, tuple[str, CostTerms]]:
        """Replica -> (its pool, the cost terms routing uses for it): the capture's fit lines."""
        return {
            name: (r.pool.name, learner.terms_of(name)) for name, r in registry.replicas.items()
        }

    return Capture(config.capture, partial(capture_header, config, registry), metrics, terms_in_use)


def _prewarmer(
    config: GatewayConfig,
    client: httpx.AsyncClient,
    registry: Registry,
    index: Index,
    metrics: Metrics,
) -> Prewarmer:
    return Prewarmer(
        config.prewarm,
        client,
        registry,
        index,
        metrics,
        block_size_tokens=config.routing.block_size_tokens,
    )


def _scraper(config: GatewayConfig, client: httpx.AsyncClient, registry: Registry) -> Scraper:
    em = config.engine_metrics
    return Scraper(
        client,
        registry.replicas.values(),
        interval_s=em.interval_s,
        timeout_s=em.timeout_s,
        stale_after_s=em.stale_after_s,
        block_size_tokens=config.routing.block_size_tokens,
    )


# ------------------------------------------------------------------- what the parts are told


class _ReplicaChanged:
    """The registry's health-change hook; the index and feeds it reads are set by `_routing`."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.index: Index | None = None
        self.speculative: SpeculativeIndex | None = None
        self.kv_events: KvEvents | None = None

    async def __call__(self, replica: Replica, healthy: bool) -> None:
        self.metrics.replica_healthy.labels(replica.name).set(1 if healthy else 0)
        if healthy:
            if replica.ejection_reason is not None:
                self.metrics.readmissions.labels(replica.name, replica.ejection_reason).inc()
            return
        reason = replica.ejection_reason or "health_check"
        self.metrics.ejections.labels(replica.name, reason).inc()
        if self.kv_events is not None and replica.name in self.kv_events.feeds:
            self.kv_events.feeds[replica.name].replica_down()
        # Its cache may be gone (restart) or unreachable; stale entries would route to it.
        index = self.speculative if self.speculative is not None else self.index
        if index is None:
            return
        try:
            await index.drop_replica(replica.name)
        except Exception as err:
            self.metrics.index_errors.labels("drop_replica").inc()
            log.warning("could not drop %s from the index: %r", replica.name, err)


def _index_failed(metrics: Metrics, op: str, err: BaseException) -> None:
    metrics.index_errors.labels(op).inc()
    log.warning("shared index %s failed, serving on the local view: %r", op, err)


def _tenant_refreshed(metrics: Metrics, error_kind: str | None) -> None:
    if error_kind is None:
        metrics.tenants_loaded.set(1)
    else:
        metrics.tenant_refresh_errors.labels(error_kind).inc()


# ------------------------------------------------------------ components that are not one loop


def _gc_pauses(metrics: Metrics) -> Component:
    async def install() -> None:
        metrics.gc_pauses.install()

    async def uninstall() -> None:
        metrics.gc_pauses.uninstall()

    return Resource("gc-pauses", opened=install, closed=uninstall)


def _capture(capture: Capture) -> Component:
    """Opens (and rotates) the file, and flushes it at the end, off the event loop."""
    return Resource(
        "capture",
        opened=partial(asyncio.to_thread, capture.start),
        closed=partial(asyncio.to_thread, capture.close),
    )


async def _replicas_unhealthy(gw: Gateway) -> None:
    """Every configured replica reads unhealthy until its first health check passes."""
    for replica in gw.registry.replicas.values():
        gw.metrics.replica_healthy.labels(replica.name).set(0)


def _sighup(reloader: Reloader) -> Component:
    stops: list[Callable[[], None]] = []

    async def install() -> None:
        stops.append(install_sighup(reloader))

    async def remove() -> None:
        while stops:
            stops.pop()()

    return Resource("sighup-reload", opened=install, closed=remove)


async def _follow_pools(gw: Gateway) -> None:
    """Discovered pools: resolved once before the gateway serves, then followed."""
    await gw.discovery.sync(gw.config.pools)


async def _load_tenants(gw: Gateway) -> None:
    """The first read of the tenants, before the gateway serves (gateway/tenancy/store.py)."""
    await gw.tenants.load()
    if not gw.tenants.open_mode and not gw.tenants.list():  # say it, do not guess
        log.warning("%s", no_tenant_warning(gw.config))


def _siblings(siblings: Siblings) -> Component:
    async def close() -> None:
        siblings.close()

    return Background("siblings", siblings.start, finish=close)


def _kv_events(kv_events: KvEvents) -> Component:
    """Precise mode: one subscriber task per replica's KV-event feed."""
    return Background("kv-events", kv_events.start, finish=kv_events.aclose)
