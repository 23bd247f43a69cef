"""What clients reach: where the gateway listens, its header and body deadlines, the body fields
clients may not set, and the exposure of /metrics, /ready and /debug."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal

from pydantic import Field, field_validator

from gateway.config.base import PositiveFloat, Strict
from gateway.config.tenants import ApiKey
from routing.types import TenantClass

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# 8 MiB: a 128k-token prompt is ~512 KiB of text; the rest is headroom for base64 images.


DEFAULT_HEADER_TIMEOUT_S = 20.0
# Apache httpd's mod_reqtimeout default (RequestReadTimeout header=20-40): a client that has not
# sent its whole request line and headers by then is cut off.
DEFAULT_BODY_TIMEOUT_S = 60.0
# nginx's client_body_timeout default (60 s), here for the whole body: the default 8 MiB body
# then needs ~140 KB/s, a client slower than that is treated as one holding a connection open.


class ListenConfig(Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    forwarded_allow_ips: list[str] = Field(
        default_factory=list,
        description="Peers trusted to say who the client is (X-Forwarded-For, "
        "X-Forwarded-Proto): addresses or networks of the load balancer or ingress in front, "
        'e.g. [10.0.0.0/8], or ["*"] to trust any peer. The failed-authentication limit '
        "counts requests without a valid key by that client address. Empty (the default): "
        "no peer is trusted, not even loopback, and the peer's own address counts.",
    )

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _addresses(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            if entry == "*":
                continue
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(
                    f"{entry!r} is not an IP address or network (or '*' for any peer)"
                ) from None
        return entries

    @property
    def trusted_proxies(self) -> str:
        """uvicorn's forwarded_allow_ips: "" trusts no peer (uvicorn's own default trusts
        loopback, which lets any local process forge a client address)."""
        return ",".join(self.forwarded_allow_ips)

    header_timeout_s: PositiveFloat = Field(
        default=DEFAULT_HEADER_TIMEOUT_S,
        description="A connection that has not sent a whole request line and headers this long "
        "after it opened (or after its previous answer) is closed. 20: Apache mod_reqtimeout's "
        "default. Applies under `cachelane serve` (its HTTP protocol, gateway/http/exposure.py).",
    )
    body_timeout_s: PositiveFloat = Field(
        default=DEFAULT_BODY_TIMEOUT_S,
        description="Longest time to receive a request's whole body once its headers are in; "
        "past it the gateway answers 408 and closes the connection. 60: nginx's "
        "client_body_timeout, here for the whole body.",
    )


# body_fields.deny's default: the engines' control fields, from their OpenAI request models:
# - vLLM (vllm/entrypoints/openai/protocol.py, ChatCompletionRequest / CompletionRequest):
#   `priority` (the scheduler's order under --scheduling-policy priority), `kv_transfer_params`
#   (where a disaggregated engine fetches or sends KV), `vllm_xargs` (arguments for plugins),
#   `request_id` (the engine's id of the request).
# - SGLang (python/sglang/srt/entrypoints/openai/protocol.py): `rid` (its request id),
#   `bootstrap_host`, `bootstrap_port`, `bootstrap_room` (prefill-decode disaggregation's
#   hand-off).
# `cache_salt` is not in it: a client's salt only narrows its own sharing, and the gateway folds it
# into the tenant's (gateway/serving/planner.py engine_salt).
ENGINE_CONTROL_FIELDS = (
    "priority",
    "kv_transfer_params",
    "vllm_xargs",
    "request_id",
    "rid",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
)


class BodyFieldsConfig(Strict):
    """Request body fields clients must not set (gateway/http/exposure.py)."""

    deny: list[str] = Field(
        default_factory=lambda: list(ENGINE_CONTROL_FIELDS),
        description="Top-level body fields a request is refused for (400 field_not_allowed): "
        "by default the engine-control fields of vLLM and SGLang (scheduling priority, "
        "disaggregation and KV-transfer parameters, request ids, plugin arguments); the "
        "gateway sets `priority` itself from the class (pools[].engine_priority).",
    )
    allow: dict[TenantClass, list[str]] = Field(
        default_factory=dict,
        description="Fields of `deny` a class may send after all, e.g. {critical: [priority]}.",
    )


class ExposureConfig(Strict):
    """Who may read the gateway's own endpoints (gateway/http/exposure.py)."""

    docs: bool = Field(
        default=False,
        description="Serve /docs, /redoc and /openapi.json (the OpenAPI schema of the "
        "endpoints). Off: 404.",
    )
    metrics_auth: bool = Field(
        default=False,
        description="/metrics (tenant names, classes, replica names) needs `Authorization: "
        "Bearer` with the monitoring key (api_key below) or the admin key.",
    )
    ready_auth: bool = Field(
        default=False,
        description="/ready (replicas, their errors, the index) needs the monitoring or admin "
        "key. /health stays open for liveness probes.",
    )
    decision_headers: Literal["all", "admin", "none"] = Field(
        default="all",
        description="Who sees the routing decision on an answer (x-cachelane-replica, -reason, "
        "-fallback, -tenant-class, -remote-write): all, admin (requests that present the admin "
        "key, as their bearer or in x-cachelane-admin-key), or none. It names replicas: a "
        "fleet's topology.",
    )
    estimate_headers: Literal["all", "admin", "none"] = Field(
        default="all",
        description="Who sees the estimate on an answer (x-cachelane-est-ttft-ms, "
        "-est-terms-ms, -expected-cached-tokens, -expected-tiers), with the same choices as "
        "decision_headers.",
    )
    api_key_sha256: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{64}$", description="The monitoring key's SHA-256."
    )
    api_key: ApiKey | None = Field(
        default=None,
        description="The monitoring key: reads /metrics and /ready and nothing else (give it "
        "as api_key_file or ${VAR}).",
    )

    @property
    def key_configured(self) -> bool:
        return self.api_key is not None or self.api_key_sha256 is not None
