"""The gateway's YAML config, validated at start-up.

Every model forbids unknown keys, so a typo fails loudly with the key's path instead of
silently falling back to a default. Cost constants default to routing/cost.py (sources there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, HttpUrl, ValidationError, model_validator

from routing.cost import (
    HBM_CAPACITY_TOKENS,
    KV_BYTES_PER_TOKEN,
    PCIE_GBPS,
    PREFILL_CHUNK_TOKENS,
    PREFILL_TOKENS_PER_S,
    REMOTE_FIXED_S,
    REMOTE_GBPS,
    PoolCosts,
)
from routing.decide import Policy
from routing.filters import Fallback
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS
from routing.index import DEFAULT_TTL_S
from routing.types import TenantClass

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# 8 MiB: a 128k-token prompt is ~512 KiB of text; the rest is headroom for base64 images.

PositiveFloat = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CostsConfig(Strict):
    kv_bytes_per_token: PositiveInt = KV_BYTES_PER_TOKEN
    prefill_tokens_per_s: PositiveFloat = PREFILL_TOKENS_PER_S
    pcie_gbps: PositiveFloat = PCIE_GBPS
    remote_gbps: PositiveFloat = REMOTE_GBPS
    remote_fixed_s: Annotated[float, Field(ge=0)] = REMOTE_FIXED_S
    prefill_chunk_tokens: PositiveInt = PREFILL_CHUNK_TOKENS

    def to_pool_costs(self) -> PoolCosts:
        return PoolCosts(**self.model_dump())


class SimConfig(Strict):
    """Read only by `cachelane sim --config`: how the simulator behaves for this pool."""

    itl_s: PositiveFloat | None = None
    time_factor: PositiveFloat = 1.0


class AdmissionConfig(Strict):
    """Per-replica admission cap of a pinned pool: above it, critical traffic takes the fallback."""

    max_in_flight: PositiveInt | None = None
    max_prefill_tokens: PositiveInt | None = None


class PoolConfig(Strict):
    name: str
    replicas: list[HttpUrl] = Field(min_length=1)
    pinned: bool = False  # reserved for critical tenants
    hbm_only: bool = False  # replicas run without CPU or remote offload
    admission: AdmissionConfig = AdmissionConfig()
    lend_below: Annotated[float, Field(gt=0, le=1)] | None = None  # standard may borrow it below
    cache_salt: bool = False  # add a per-tenant "cache_salt" to request bodies (vLLM >= 0.9)
    models: list[str] = Field(default_factory=list)  # empty: discovered from /v1/models
    hbm_capacity_tokens: PositiveInt = HBM_CAPACITY_TOKENS
    cpu_capacity_tokens: Annotated[int, Field(ge=0)] = 0  # 0: no CPU offload tier
    remote_tier: str | None = None
    max_prompt_tokens: PositiveInt | None = None
    costs: CostsConfig = CostsConfig()
    sim: SimConfig = SimConfig()


class RemoteTierConfig(Strict):
    name: str
    url: HttpUrl | None = None  # the simulator's remote tier service; real tiers are engine-side
    capacity_tokens: PositiveInt = 10_000_000


class IndexConfig(Strict):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_cluster: bool = False
    ttl_s: PositiveFloat = DEFAULT_TTL_S


class RoutingConfig(Strict):
    policy: Policy = Policy.CACHE_AWARE
    block_size_tokens: PositiveInt = DEFAULT_BLOCK_SIZE_TOKENS
    seed: int = 0


class HealthConfig(Strict):
    interval_s: PositiveFloat = 2.0
    timeout_s: PositiveFloat = 1.0
    fail_after: PositiveInt = 2  # consecutive failed checks before a replica is ejected


class EngineMetricsConfig(Strict):
    """Scraping each replica's /metrics (vLLM or SGLang names) for load from other gateways."""

    enabled: bool = True
    interval_s: PositiveFloat = 1.0  # vLLM updates its scheduler gauges every engine step
    timeout_s: PositiveFloat = 0.5
    stale_after_s: PositiveFloat = 5.0  # older scrapes are ignored: own counts only


class UpstreamConfig(Strict):
    connect_timeout_s: PositiveFloat = 2.0
    read_timeout_s: PositiveFloat = 600.0  # a long generation may stream for minutes
    max_connections: PositiveInt = 1024
    retries: Annotated[int, Field(ge=0, le=5)] = 2  # other replicas tried before the first byte


class ListenConfig(Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000


class TenantConfig(Strict):
    name: str = Field(min_length=1)
    api_key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    api_key: str | None = Field(default=None, min_length=8)  # prefer api_key_sha256 in files
    tenant_class: TenantClass = Field(default=TenantClass.STANDARD, alias="class")
    share_group: str | None = None  # tenants in one group share prefix cache

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _one_key(self) -> TenantConfig:
        if (self.api_key is None) == (self.api_key_sha256 is None):
            raise ValueError(f"tenant {self.name!r}: give exactly one of api_key, api_key_sha256")
        return self


class AdminConfig(Strict):
    api_key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    api_key: str | None = Field(default=None, min_length=8)


class CriticalConfig(Strict):
    fallback: Fallback = Fallback.SPILL  # when the pinned pool is down or over its cap
    retry_after_s: PositiveInt = 1


class PrewarmConfig(Strict):
    enabled: bool = False
    hot_after: PositiveInt = 3  # requests of a prefix family in the reuse window before it is hot
    max_per_s: PositiveFloat = 2.0  # warms sent per second by one gateway
    budget_tokens_per_min: PositiveInt = 1_000_000
    # 1M prompt tokens/min = ~0.55 s of prefill per second at 30k tokens/s: at most about half a
    # GPU's prefill time goes to warming, across the whole fleet, per gateway.
    method: Literal["completion", "prefetch"] = "completion"  # prefetch: the simulator's call
    queue_size: PositiveInt = 64
    timeout_s: PositiveFloat = 30.0


class OverloadConfig(Strict):
    batch_max_queue_s: PositiveFloat = 5.0  # batch is shed when its best queue is longer


class GatewayConfig(Strict):
    listen: ListenConfig = ListenConfig()
    routing: RoutingConfig = RoutingConfig()
    index: IndexConfig = IndexConfig()
    health: HealthConfig = HealthConfig()
    engine_metrics: EngineMetricsConfig = EngineMetricsConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    tenants: list[TenantConfig] = Field(default_factory=list)  # empty: no authentication
    admin: AdminConfig = AdminConfig()
    critical: CriticalConfig = CriticalConfig()
    overload: OverloadConfig = OverloadConfig()
    prewarm: PrewarmConfig = PrewarmConfig()
    max_body_bytes: PositiveInt = DEFAULT_MAX_BODY_BYTES
    remote_tiers: list[RemoteTierConfig] = Field(default_factory=list)
    pools: list[PoolConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_references(self) -> GatewayConfig:
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pools: duplicate pool name in {names}")
        tiers = {t.name for t in self.remote_tiers}
        for i, pool in enumerate(self.pools):
            if pool.remote_tier is not None and pool.remote_tier not in tiers:
                raise ValueError(
                    f"pools.{i}.remote_tier: {pool.remote_tier!r} is not one of "
                    f"remote_tiers {sorted(tiers)}"
                )
        tenant_names = [t.name for t in self.tenants]
        if len(set(tenant_names)) != len(tenant_names):
            raise ValueError(f"tenants: duplicate tenant name in {tenant_names}")
        urls = [str(u) for p in self.pools for u in p.replicas]
        if len(set(urls)) != len(urls):
            raise ValueError("pools: a replica URL appears twice")
        return self


class ConfigError(Exception):
    """The config file is missing, not YAML, or fails validation; the message names the key."""


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {where}: {e['msg']}")
    return "\n".join(lines)


def parse_config(data: object, source: str = "config") -> GatewayConfig:
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source} is invalid:\n{_describe(err)}") from None


def load_config(path: str | Path) -> GatewayConfig:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read config {p}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{p} is not valid YAML: {err}") from None
    return parse_config(data, str(p))


def quick_config(
    replica_urls: list[str], *, policy: Policy = Policy.CACHE_AWARE, host: str, port: int
) -> GatewayConfig:
    """Config for `cachelane serve --replicas ...`: one pool, defaults everywhere."""
    return parse_config(
        {
            "listen": {"host": host, "port": port},
            "routing": {"policy": policy.value},
            "pools": [{"name": "default", "replicas": replica_urls}],
        },
        "--replicas",
    )
