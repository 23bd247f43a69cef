"""Who may call: tenants, the admin key, the auth mode and its secret, and rate limits."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field, field_validator, model_validator

from gateway.config.base import NonNegativeInt, PositiveInt, Strict
from gateway.tenancy.keys import MIN_API_KEY_CHARS, MIN_SECRET_CHARS
from gateway.tenancy.tenants import name_problem
from routing.types import TenantClass


def _long_enough(key: str | None) -> str | None:
    if key is not None and len(key) < MIN_API_KEY_CHARS:
        raise ValueError(
            f"an API key needs at least {MIN_API_KEY_CHARS} characters (this one has "
            f"{len(key)}); make one with `openssl rand -hex {MIN_API_KEY_CHARS // 2}`"
        )
    return key


ApiKey = Annotated[str, AfterValidator(_long_enough)]


class TenantConfig(Strict):
    name: str = Field(min_length=1)
    api_key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    api_key: ApiKey | None = None  # prefer api_key_sha256 in files
    tenant_class: TenantClass = Field(default=TenantClass.STANDARD, alias="class")
    share_group: str | None = None  # tenants in one group share prefix cache

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("name", "share_group")
    @classmethod
    def _safe_name(cls, name: str | None) -> str | None:
        problem = None if name is None else name_problem(name)
        if problem is not None:
            raise ValueError(f"{name!a} {problem} (gateway/tenancy/tenants.py)")
        return name

    @model_validator(mode="after")
    def _one_key(self) -> TenantConfig:
        if (self.api_key is None) == (self.api_key_sha256 is None):
            raise ValueError(f"tenant {self.name!r}: give exactly one of api_key, api_key_sha256")
        return self


class AdminConfig(Strict):
    api_key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    api_key: ApiKey | None = None

    @property
    def configured(self) -> bool:
        return self.api_key is not None or self.api_key_sha256 is not None


class AuthConfig(Strict):
    """How requests are authenticated (gateway/tenancy/store.py) and what signs tenant records."""

    allow_example_keys: bool = Field(
        default=False,
        description="Start even if a key or secret is one of the examples published in this "
        "repository (deploy/: `change-me-*`, `*-not-for-production`, the digests in "
        "deploy/examples). A development flag: the docker compose demo sets it; anywhere else "
        "the gateway refuses to start with them.",
    )

    mode: Literal["keys", "open"] = Field(
        default="keys",
        description="keys: every request needs the key of a live tenant; with no tenant, every "
        "request is refused (fails closed). open: no key is checked, every request is served "
        "as the anonymous standard tenant (development; no tenants or admin key allowed).",
    )
    secret: str | None = Field(
        default=None,
        min_length=MIN_SECRET_CHARS,
        description="HMAC key the gateways share: it signs the tenant records they keep in "
        "Redis (a record without a valid signature is ignored) and keys the digests of API "
        "keys. Required with index.backend redis in mode keys; give it as secret_file or "
        "${VAR}. Unset without Redis: a random one per process.",
    )


DEFAULT_FAILED_AUTH_PER_MIN = 30
# A client with a wrong key that retries as the openai SDK does (3 tries a request) has 10 requests
# a minute answered 401 before 429. Guessing a 32-character key is hopeless at any rate: this
# bounds the work a stream of bad keys makes, not the odds of a guess.


class RateLimit(Strict):
    requests_per_min: PositiveInt | None = Field(
        default=None, description="Requests a minute. Unset: no request limit."
    )
    tokens_per_min: PositiveInt | None = Field(
        default=None,
        description="Tokens a minute: the prompt's estimate at admission, corrected by the "
        "engine's usage.total_tokens (prompt and completion) when the answer reports it. "
        "Unset: no token limit.",
    )


class RateLimitsConfig(Strict):
    """Per-tenant rate limits (gateway/tenancy/rate_limits.py): each tenant has its own budget,
    shared by every gateway through Redis when the index is there."""

    classes: dict[TenantClass, RateLimit] = Field(
        default_factory=dict,
        description="Limits of every tenant of a class (its own class, whatever class a "
        "request asks for), each {requests_per_min, tokens_per_min}, e.g. {standard: "
        "{requests_per_min: 600, tokens_per_min: 1000000}}; unset: no limit of that kind. Each "
        "tenant has its own budget. Tokens: the prompt's estimate at admission, corrected by "
        "the engine's usage.total_tokens (prompt and completion) when the answer reports it, "
        "else by the token events a stream sent.",
    )
    tenants: dict[str, RateLimit] = Field(
        default_factory=dict,
        description="Limits of one tenant by name; a limit given here replaces its class's.",
    )
    failed_auth_per_min: NonNegativeInt = Field(
        default=DEFAULT_FAILED_AUTH_PER_MIN,
        description="Failed authentications (401) a client address, or a key, may make a "
        "minute; past it, its requests without a valid key get 429 with Retry-After until the "
        "minute allows more, at most 60 s after its last failure. A valid key is never refused "
        "by this limit, nor are /health, /ready and /metrics. Behind a load "
        "balancer set listen.forwarded_allow_ips to its addresses (the client's is then taken "
        "from X-Forwarded-For), or every client without a key shares its address. 0: no limit.",
    )
