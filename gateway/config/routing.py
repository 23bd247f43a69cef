"""How a replica is chosen and watched: the index, routing, health checks, engine metrics, the
upstream client."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from gateway.config.base import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Strict
from gateway.config.pools import (
    DEFAULT_EJECT_AFTER_ERRORS,
    DEFAULT_EJECTION_FACTOR,
    DEFAULT_EJECTION_S,
    DEFAULT_MAX_EJECTION_S,
)
from routing.decide import Policy
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS
from routing.index import DEFAULT_TTL_S


class IndexConfig(Strict):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_cluster: bool = False
    ttl_s: PositiveFloat = DEFAULT_TTL_S


class RoutingConfig(Strict):
    policy: Policy = Policy.CACHE_AWARE
    mode: Literal["approximate", "precise"] = Field(
        default="approximate",
        description="approximate: hash prompt text, index what the gateway sent (any engine). "
        "precise: hash the engine's token ids, index what the engines report in their KV events "
        "(every pool needs kv_events, tokenizer and exactly one model).",
    )
    block_size_tokens: PositiveInt = DEFAULT_BLOCK_SIZE_TOKENS
    seed: int = 0
    calibration: Literal["fit", "correction", "none"] = Field(
        default="fit",
        description="How estimates follow the fleet. fit: each replica's costs (fixed overhead, "
        "per prefill / swapped / fetched token) fitted online from observed TTFTs, seeded from "
        "the pool's costs. correction: one bounded multiplicative factor per replica (the older "
        "scheme, kept as a baseline). none: the pool's costs as configured.",
    )


class HealthConfig(Strict):
    interval_s: PositiveFloat = 2.0
    timeout_s: PositiveFloat = 1.0
    fail_after: PositiveInt = 2  # consecutive failed checks before a replica is ejected
    eject_after_errors: NonNegativeInt = Field(
        default=DEFAULT_EJECT_AFTER_ERRORS,
        description="Passive health: consecutive failures of a replica's own traffic (5xx "
        "answers, first-byte timeouts, broken connections, answers that are not JSON or an "
        "event stream) before it is ejected (Envoy's outlier detection, consecutive_5xx), when "
        "they are requests of two tenants or more; one tenant's alone make it a suspect that "
        "a probe generation of the gateway's own ejects only if it fails. A refused "
        "connection ejects at once. 0: off.",
    )
    ejection_s: NonNegativeFloat = Field(
        default=DEFAULT_EJECTION_S,
        description="A replica ejected for how its requests went (5xx, first-byte timeouts, a "
        "refused connection) stays out at least this long (Envoy's base_ejection_time), then "
        "must answer a probe generation (max_tokens 1) before traffic returns.",
    )
    ejection_factor: Annotated[float, Field(ge=1)] = Field(
        default=DEFAULT_EJECTION_FACTOR,
        description="Each ejection in a row (a failed probe counts one) multiplies the time out "
        "by this (exponential back-off, as Envoy's retry back-off doubles).",
    )
    max_ejection_s: NonNegativeFloat = Field(
        default=DEFAULT_MAX_EJECTION_S,
        description="The longest time out of one ejection (Envoy's max_ejection_time).",
    )


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
