"""The gateway's YAML config, validated at start-up.

Every model forbids unknown keys, so a typo fails loudly with the key's path instead of
silently falling back to a default. Cost constants default to routing/cost.py (sources there).

One module a section: base (the strict model), engines, pools, routing (index, routing, health,
engine metrics, upstream), exposure (listen, body fields, /metrics and /debug), tenants (tenants,
admin, auth, rate limits), classes (critical, classes, flow control, overload, prewarm),
telemetry (tracing, capture), root (GatewayConfig and its cross-section checks), example_keys,
load (parse_config, load_config, quick_config). Import the names from `gateway.config`.
"""

from __future__ import annotations

from gateway.config.base import PositiveFloat, PositiveInt, Strict, url_key
from gateway.config.classes import (
    MAX_TTFT_SLO_MS,
    ClassConfig,
    ClassesConfig,
    CriticalConfig,
    FlowControlConfig,
    OverloadConfig,
    PrewarmConfig,
)
from gateway.config.engines import (
    AdmissionConfig,
    CostsConfig,
    EngineConfig,
    KvEventsConfig,
    SimConfig,
    TokenizerConfig,
)
from gateway.config.example_keys import EXAMPLE_DIGESTS, EXAMPLE_MARKERS, is_example, password_of
from gateway.config.exposure import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    ENGINE_CONTROL_FIELDS,
    BodyFieldsConfig,
    ExposureConfig,
    ListenConfig,
)
from gateway.config.load import ConfigError, load_config, parse_config, quick_config
from gateway.config.pools import (
    DEFAULT_DISCOVERY_INTERVAL_S,
    DEFAULT_EJECT_AFTER_ERRORS,
    DEFAULT_EJECTION_FACTOR,
    DEFAULT_EJECTION_S,
    DEFAULT_FIRST_BYTE_TIMEOUT_S,
    DEFAULT_MAX_EJECTION_S,
    DEFAULT_MIN_DECODE_TOKENS_PER_S,
    UNFORWARDABLE_HEADERS,
    DiscoveryConfig,
    PoolConfig,
    RemoteTierConfig,
    forwardable,
    nameserver_address,
)
from gateway.config.root import GatewayConfig, example_keys_in, no_tenant_warning
from gateway.config.routing import (
    EngineMetricsConfig,
    HealthConfig,
    IndexConfig,
    RoutingConfig,
    UpstreamConfig,
)
from gateway.config.telemetry import (
    DEFAULT_CAPTURE_MAX_BYTES,
    DEFAULT_CAPTURE_MAX_RECORDS,
    CaptureConfig,
    TracingConfig,
)
from gateway.config.tenants import (
    DEFAULT_FAILED_AUTH_PER_MIN,
    AdminConfig,
    ApiKey,
    AuthConfig,
    RateLimit,
    RateLimitsConfig,
    TenantConfig,
)

__all__ = [
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_CAPTURE_MAX_BYTES",
    "DEFAULT_CAPTURE_MAX_RECORDS",
    "DEFAULT_DISCOVERY_INTERVAL_S",
    "DEFAULT_EJECTION_FACTOR",
    "DEFAULT_EJECTION_S",
    "DEFAULT_EJECT_AFTER_ERRORS",
    "DEFAULT_FAILED_AUTH_PER_MIN",
    "DEFAULT_FIRST_BYTE_TIMEOUT_S",
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_EJECTION_S",
    "DEFAULT_MIN_DECODE_TOKENS_PER_S",
    "ENGINE_CONTROL_FIELDS",
    "EXAMPLE_DIGESTS",
    "EXAMPLE_MARKERS",
    "MAX_TTFT_SLO_MS",
    "UNFORWARDABLE_HEADERS",
    "AdminConfig",
    "AdmissionConfig",
    "ApiKey",
    "AuthConfig",
    "BodyFieldsConfig",
    "CaptureConfig",
    "ClassConfig",
    "ClassesConfig",
    "ConfigError",
    "CostsConfig",
    "CriticalConfig",
    "DiscoveryConfig",
    "EngineConfig",
    "EngineMetricsConfig",
    "ExposureConfig",
    "FlowControlConfig",
    "GatewayConfig",
    "HealthConfig",
    "IndexConfig",
    "KvEventsConfig",
    "ListenConfig",
    "OverloadConfig",
    "PoolConfig",
    "PositiveFloat",
    "PositiveInt",
    "PrewarmConfig",
    "RateLimit",
    "RateLimitsConfig",
    "RemoteTierConfig",
    "RoutingConfig",
    "SimConfig",
    "Strict",
    "TenantConfig",
    "TokenizerConfig",
    "TracingConfig",
    "UpstreamConfig",
    "example_keys_in",
    "forwardable",
    "is_example",
    "load_config",
    "nameserver_address",
    "no_tenant_warning",
    "parse_config",
    "password_of",
    "quick_config",
    "url_key",
]

# The public classes print as gateway.config.X, the path they are imported from (deploy/CONFIG.md
# shows field types by that name), whichever section module defines them.
for _name in __all__:
    _value = globals()[_name]
    if isinstance(_value, type):
        _value.__module__ = __name__
del _name, _value
