"""The whole config file (GatewayConfig) and the checks that span its sections."""

from __future__ import annotations

from pydantic import Field, model_validator

from gateway import extras
from gateway.config.base import PositiveInt, Strict, url_key
from gateway.config.classes import (
    ClassesConfig,
    CriticalConfig,
    FlowControlConfig,
    OverloadConfig,
    PrewarmConfig,
)
from gateway.config.example_keys import is_example, password_of
from gateway.config.exposure import (
    DEFAULT_MAX_BODY_BYTES,
    BodyFieldsConfig,
    ExposureConfig,
    ListenConfig,
)
from gateway.config.pools import PoolConfig, RemoteTierConfig
from gateway.config.routing import (
    EngineMetricsConfig,
    HealthConfig,
    IndexConfig,
    RoutingConfig,
    UpstreamConfig,
)
from gateway.config.telemetry import CaptureConfig, TracingConfig
from gateway.config.tenants import AdminConfig, AuthConfig, RateLimitsConfig, TenantConfig
from gateway.extras import PRECISE_MODULES, missing_message
from gateway.http.body import DEFAULT_MAX_JSON_DEPTH, DEFAULT_MAX_NUMBER_CHARS, MAX_JSON_DEPTH_LIMIT
from gateway.tenancy.keys import MIN_SECRET_CHARS, sha256_hex


class GatewayConfig(Strict):
    listen: ListenConfig = ListenConfig()
    routing: RoutingConfig = RoutingConfig()
    index: IndexConfig = IndexConfig()
    health: HealthConfig = HealthConfig()
    engine_metrics: EngineMetricsConfig = EngineMetricsConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    tenants: list[TenantConfig] = Field(default_factory=list)
    admin: AdminConfig = AdminConfig()
    auth: AuthConfig = AuthConfig()
    critical: CriticalConfig = CriticalConfig()
    classes: ClassesConfig = ClassesConfig()
    flow_control: FlowControlConfig = FlowControlConfig()
    overload: OverloadConfig = OverloadConfig()
    prewarm: PrewarmConfig = PrewarmConfig()
    tracing: TracingConfig = TracingConfig()
    capture: CaptureConfig = CaptureConfig()
    rate_limits: RateLimitsConfig = RateLimitsConfig()
    body_fields: BodyFieldsConfig = BodyFieldsConfig()
    exposure: ExposureConfig = ExposureConfig()
    max_body_bytes: PositiveInt = DEFAULT_MAX_BODY_BYTES
    max_json_depth: int = Field(DEFAULT_MAX_JSON_DEPTH, ge=2, le=MAX_JSON_DEPTH_LIMIT)
    max_number_chars: int = Field(DEFAULT_MAX_NUMBER_CHARS, ge=20)
    remote_tiers: list[RemoteTierConfig] = Field(default_factory=list)
    pools: list[PoolConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_references(self) -> GatewayConfig:
        """Every check that spans sections; all their problems at once, one a line."""
        problems = []
        for check in (_check_names, _check_auth, _check_exposure, _check_replicas):
            try:
                check(self)
            except ValueError as err:
                problems.append(str(err))
        if problems:
            raise ValueError("\n    ".join(problems))
        return self


def _check_names(config: GatewayConfig) -> None:
    names = [p.name for p in config.pools]
    if len(set(names)) != len(names):
        raise ValueError(f"pools: duplicate pool name in {names}")
    tiers = {t.name for t in config.remote_tiers}
    for i, pool in enumerate(config.pools):
        if pool.remote_tier is not None and pool.remote_tier not in tiers:
            raise ValueError(
                f"pools.{i}.remote_tier: {pool.remote_tier!r} is not one of "
                f"remote_tiers {sorted(tiers)}"
            )
    seen: dict[str, int] = {}
    for i, tenant in enumerate(config.tenants):
        first = seen.setdefault(tenant.name, i)
        if first != i:
            raise ValueError(f"tenants.{i}.name: {tenant.name!r} is tenants.{first}.name too")


def _check_replicas(config: GatewayConfig) -> None:
    urls = [str(u) for p in config.pools for u in p.replicas]
    if len(set(urls)) != len(urls):
        raise ValueError("pools: a replica URL appears twice")
    if config.routing.mode == "precise":
        _check_precise(config.pools)


def example_keys_in(config: GatewayConfig) -> list[str]:
    """The places (config paths, never the values) that hold an example key or secret."""
    found = []
    for i, t in enumerate(config.tenants):
        if is_example(t.api_key) or is_example(t.api_key_sha256):
            found.append(f"tenants.{i} ({t.name!r}).api_key")
    if is_example(config.admin.api_key) or is_example(config.admin.api_key_sha256):
        found.append("admin.api_key")
    if is_example(config.exposure.api_key) or is_example(config.exposure.api_key_sha256):
        found.append("exposure.api_key")
    for i, pool in enumerate(config.pools):
        if pool.api_key is not None and is_example(pool.api_key.get_secret_value()):
            found.append(f"pools.{i} ({pool.name!r}).api_key")
    if is_example(config.auth.secret):
        found.append("auth.secret")
    if config.index.backend == "redis" and is_example(password_of(config.index.redis_url)):
        found.append("index.redis_url (its password)")
    return found


def _check_auth(config: GatewayConfig) -> None:
    if config.auth.mode == "open":
        if config.tenants or config.admin.configured:
            raise ValueError(
                "auth.mode open serves every request as the anonymous tenant without checking "
                "keys: remove tenants and admin, or set auth.mode keys"
            )
        return
    if config.index.backend == "redis" and config.auth.secret is None:
        raise ValueError(
            "auth.secret (or auth.secret_file) is required with index.backend redis: it signs "
            "the tenant records kept there, so a write to Redis alone cannot add or change a "
            f"tenant (at least {MIN_SECRET_CHARS} characters: `openssl rand -hex 32`)"
        )
    owners: dict[str, str] = {}  # a key's SHA-256 -> who has it (the keys are never printed)
    admin = config.admin
    if admin.configured:
        owners[admin.api_key_sha256 or sha256_hex(admin.api_key or "")] = "the admin"
    for t in config.tenants:
        digest = t.api_key_sha256 or sha256_hex(t.api_key or "")
        if digest in owners:
            raise ValueError(f"tenants: {t.name!r} has the same API key as {owners[digest]}")
        owners[digest] = f"tenant {t.name!r}"


def _check_exposure(config: GatewayConfig) -> None:
    exposure = config.exposure
    if (exposure.metrics_auth or exposure.ready_auth) and not (
        exposure.key_configured or config.admin.configured
    ):
        raise ValueError(
            "exposure.metrics_auth and ready_auth need a key to check: set exposure.api_key "
            "(the monitoring key) or admin.api_key"
        )
    if not config.auth.allow_example_keys:
        found = example_keys_in(config)
        if found:
            raise ValueError(
                f"{', '.join(found)}: an example value published in this repository (deploy/); "
                "make your own (`openssl rand -hex 32`), or set auth.allow_example_keys: true "
                "on a development machine"
            )


def _check_precise(pools: list[PoolConfig]) -> None:
    missing = extras.missing_modules(PRECISE_MODULES)
    if missing:
        raise ValueError(missing_message("routing.mode precise", "precise", missing))
    for i, pool in enumerate(pools):
        where = f"pools.{i} ({pool.name!r})"
        if pool.kv_events is None or pool.tokenizer is None:
            raise ValueError(f"{where}: routing.mode precise needs kv_events and tokenizer")
        if len(pool.models) != 1:
            raise ValueError(
                f"{where}.models: routing.mode precise needs the one model the pool serves "
                "(KV events do not say which model a block belongs to)"
            )
        if pool.kv_events.endpoints is not None and pool.discovery is not None:
            raise ValueError(
                f"{where}.kv_events: a discovered pool's replicas are not known in advance: "
                "use port_offset (and replay_port_offset), not endpoints"
            )
        if pool.kv_events.endpoints is not None:
            urls = {url_key(str(u)) for u in pool.replicas}
            given = {url_key(u) for u in pool.kv_events.endpoints}
            if given != urls:
                raise ValueError(
                    f"{where}.kv_events.endpoints: keys must be the pool's replica URLs; "
                    f"missing {sorted(urls - given)}, unknown {sorted(given - urls)}"
                )
    if len({p.cache_salt for p in pools}) > 1:
        raise ValueError(
            "pools: routing.mode precise needs the same cache_salt on every pool (it is part of "
            "the engine's block hash, so it decides which prefixes are shared)"
        )


def no_tenant_warning(config: GatewayConfig) -> str:
    """What a gateway in auth mode keys without a tenant does: refuse every request."""
    how = (
        "add one with the admin API (PUT /admin/tenants/NAME) or under `tenants:`"
        if config.admin.configured
        else "add one under `tenants:` (or set admin.api_key to add them at run time)"
    )
    return (
        "no request can be served: auth.mode is keys (the default for a config file) and no "
        f"tenant has a key, so every request is refused 401; {how}, or set auth.mode: open "
        "to serve everyone as the anonymous tenant (as `cachelane serve --replicas` does)"
    )
