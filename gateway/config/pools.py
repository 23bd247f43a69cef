"""Pools of replicas: their engines, discovery, timeouts, ejection, credentials and forwarded
headers; remote tiers."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

from pydantic import Field, HttpUrl, SecretStr, field_validator, model_validator

from gateway.config.base import NonNegativeInt, PositiveFloat, PositiveInt, Strict
from gateway.config.engines import (
    AdmissionConfig,
    CostsConfig,
    EngineConfig,
    KvEventsConfig,
    SimConfig,
    TokenizerConfig,
)
from routing.cost import HBM_CAPACITY_TOKENS

# Which client headers a pool may forward (pools[].forward_headers), checked as the config loads;
# gateway/fleet/replica_auth.py forwards them.
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9a-z-]+$")  # RFC 9110 section 5.6.2 token
UNFORWARDABLE_HEADERS = frozenset(
    {
        # the client's credentials for the gateway, and the gateway's own for the replica
        "authorization",
        "proxy-authorization",
        "cookie",
        # set by the gateway for the body it sends, its request id and its trace
        "content-type",
        "content-length",
        "content-encoding",
        "host",
        "x-request-id",
        "traceparent",
        "tracestate",
        # hop-by-hop (RFC 9110 section 7.6.1)
        "connection",
        "proxy-connection",
        "keep-alive",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


def forwardable(name: str) -> str:
    """A `forward_headers` entry, lowercased; ValueError if it may not be forwarded."""
    name = name.strip().lower()
    if not _HEADER_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not an HTTP header name")
    if name in UNFORWARDABLE_HEADERS or name.startswith("x-cachelane-"):
        raise ValueError(
            f"{name!r} cannot be forwarded: the gateway sets it, it belongs to one "
            "connection, or it carries the client's credentials"
        )
    return name


DEFAULT_FIRST_BYTE_TIMEOUT_S = 60.0
# 60 s: nginx's proxy_read_timeout default (the wait for an upstream's answer in most proxies put in
# front of vLLM). A 128k-token prompt prefills in ~4 s at routing/cost.py's PREFILL_TOKENS_PER_S,
# so the rest is room for the engine's own queue (flow control keeps that short).
DEFAULT_EJECT_AFTER_ERRORS = 5  # Envoy's outlier_detection.consecutive_5xx default
DEFAULT_EJECTION_S = 30.0  # Envoy's outlier_detection.base_ejection_time default
DEFAULT_EJECTION_FACTOR = 2.0
# each ejection in a row doubles the time out: the multiplier of Envoy's retry back-off
# (config.route.v3.RetryPolicy.RetryBackOff: "exponential back-off ... base_interval" x 2^n)
DEFAULT_MAX_EJECTION_S = 300.0  # Envoy's outlier_detection.max_ejection_time default
DEFAULT_MIN_DECODE_TOKENS_PER_S = 10.0
# a tenth of the decode rate loadtest/sim/config.py's ITL_S derives for an 8B model on an H200 at
# a batch of 32 (10 ms per token, memory-bound): a replica slower than this for a whole answer is
# taken as hung, not busy. Engines on CPU or much larger models want it lower.


DEFAULT_DISCOVERY_INTERVAL_S = 5.0
# 5 s: the TTL CoreDNS's kubernetes plugin gives its records by default, so a change is seen about
# as soon as a caching resolver would see it (a Corefile with `ttl 30` / `cache 30`, kubeadm's
# default, delays it by up to 30 s whatever the interval).


class DiscoveryConfig(Strict):
    """A pool's replicas from DNS (gateway/fleet/discovery.py), re-resolved every `interval_s`."""

    name: str = Field(
        min_length=1,
        description="The DNS name: for `type: A` one that resolves to every replica's address "
        "(a Kubernetes headless Service: SERVICE.NAMESPACE.svc.cluster.local); for `type: SRV` "
        "the SRV name (_PORTNAME._tcp.SERVICE.NAMESPACE.svc.cluster.local). A full name: no "
        "search domains are tried.",
    )
    type: Literal["A", "SRV"] = Field(
        default="A",
        description="A: the name's A and AAAA records, each address one replica on `port`. "
        "SRV: each target of the SRV records (its addresses) on the record's port; priorities "
        "and weights are not used (the router balances by its own estimates).",
    )
    port: Annotated[int, Field(ge=1, le=65535)] | None = Field(
        default=None, description="The replicas' HTTP port (type A; SRV records carry theirs)."
    )
    scheme: Literal["http", "https"] = Field(
        default="http", description="How the replicas are reached: http://ADDRESS:PORT."
    )
    interval_s: PositiveFloat = Field(
        default=DEFAULT_DISCOVERY_INTERVAL_S,
        description="Seconds between resolutions (5: the TTL CoreDNS's kubernetes plugin gives "
        "its records). Replicas that appear are added (health "
        "checked at once), those that disappear are removed: no new requests, those in flight "
        "finish, their index entries are dropped. A failed resolution (timeout, SERVFAIL) "
        "keeps the replicas as they were; a name that does not exist (NXDOMAIN) or has no "
        "record means no replica.",
    )
    timeout_s: PositiveFloat = Field(default=2.0, description="Longest one resolution may take.")
    nameservers: list[str] = Field(
        default_factory=list,
        description="Resolvers to ask, as IP, IP:PORT or [IPv6]:PORT. Empty: the system's "
        "(/etc/resolv.conf).",
    )

    @model_validator(mode="after")
    def _check(self) -> DiscoveryConfig:
        if self.type == "A" and self.port is None:
            raise ValueError("type A needs the replicas' port")
        if self.type == "SRV" and self.port is not None:
            raise ValueError("type SRV takes each replica's port from its record: drop port")
        for server in self.nameservers:
            nameserver_address(server)
        return self


def nameserver_address(server: str) -> tuple[str, int]:
    """("10.96.0.10", 53) from "10.96.0.10", "10.96.0.10:5353", "[fd00::a]:53" or "fd00::a";
    ValueError otherwise."""
    host, port = server, "53"
    if server.startswith("["):
        host, sep, rest = server[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"nameserver {server!r}: expected [IPv6]:PORT")
        port = rest[1:] or port
    elif server.count(":") == 1:
        host, port = server.split(":")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"nameserver {server!r}: {host!r} is not an IP address") from None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"nameserver {server!r}: {port!r} is not a port")
    return host, int(port)


class PoolConfig(Strict):
    name: str
    replicas: list[HttpUrl] = Field(default_factory=list)  # or discovery
    discovery: DiscoveryConfig | None = Field(
        default=None,
        description="Instead of replicas: find them in DNS and follow its changes.",
    )
    pinned: bool = False  # reserved for critical tenants
    hbm_only: bool = False  # replicas run without CPU or remote offload
    admission: AdmissionConfig = AdmissionConfig()
    lend_below: Annotated[float, Field(gt=0, le=1)] | None = Field(
        default=1.0,
        description="A pinned pool lends a replica to standard and batch requests while it is "
        "below this fraction of its admission cap (no cap: always), except after a critical "
        "request found no pinned replica free: for as long as the pool is estimated to stay "
        "busy (critical.placement: cost) or 5 s (pinned_first; routing/pipeline.py). null: "
        "never lent.",
    )
    cache_salt: bool = Field(
        default=True,
        description="Add a per-tenant (per share group) `cache_salt` to chat, completions and "
        "responses bodies, so the engine never shares KV across tenants (vLLM >= 0.9 and the "
        "simulator take it). Set false only for an engine that rejects the field; its tenants "
        "then share the engine's prefix cache.",
    )
    engine_priority: bool = Field(
        default=False,
        description="Send each request's class as vLLM's `priority` (critical -1, standard 0, "
        "batch 1; lower runs first). Only for engines started with --scheduling-policy "
        "priority: vLLM rejects the field otherwise. The cost model then counts, for a request, "
        "the prefill under way and the work of its own or a more urgent class ahead of it, and "
        "charges a placement the wait it adds to the less urgent requests it overtakes. Unset "
        "with engine.scheduling_policy: priority, true.",
    )
    # which prompts the replicas write to the remote tier: by expected reuse (routing/admission.py),
    # all of them, or none (the last two are baselines for comparison)
    remote_write: Literal["reuse", "always", "never"] = "reuse"
    models: list[str] = Field(default_factory=list)  # empty: discovered from /v1/models
    hbm_capacity_tokens: PositiveInt | None = Field(
        default=None,
        description="KV tokens one replica's HBM holds. Unset: read from the engine's "
        "vllm:cache_config_info (num_gpu_blocks x block_size), and until then "
        f"{HBM_CAPACITY_TOKENS} (routing/cost.py HBM_CAPACITY_TOKENS).",
    )
    cpu_capacity_tokens: NonNegativeInt = 0  # 0: no CPU offload tier
    remote_tier: str | None = None
    max_prompt_tokens: PositiveInt | None = None
    first_byte_timeout_s: PositiveFloat = Field(
        default=DEFAULT_FIRST_BYTE_TIMEOUT_S,
        description="Longest wait for the first byte of a streamed answer (its first token): "
        "the hard cap of each request's own deadline, 4x its estimated TTFT + 3 s "
        "(gateway/serving/deadline.py). Past it the request is cancelled on that replica and "
        "sent to the next one, and the replica counts a failure (health.eject_after_errors); a "
        "replica marked down lets go of the requests waiting on it at once. A whole "
        "(non-streamed) answer gets its first token's deadline plus its max_tokens at "
        "min_decode_tokens_per_s.",
    )
    min_decode_tokens_per_s: PositiveFloat = Field(
        default=DEFAULT_MIN_DECODE_TOKENS_PER_S,
        description="The slowest decode (output tokens per second, one request) a healthy "
        "replica of the pool keeps. vLLM sends a whole answer's status and headers with its "
        "body, after the generation, so a whole answer's first byte is due within "
        "first_byte_timeout_s + max_tokens / min_decode_tokens_per_s (max_tokens, "
        "max_completion_tokens or max_output_tokens, else the model's max_model_len from "
        "/v1/models); past it the request is cancelled there and sent to the next replica, as "
        "a streamed one is. With no bound known, upstream.read_timeout_s does the same. "
        "Default: a tenth of a busy H200's 8B decode (loadtest/sim/config.py ITL_S).",
    )
    costs: CostsConfig = CostsConfig()
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="The replicas' engine scheduler flags, as vLLM's (the cost model's queue "
        "and prefill terms follow its step loop).",
    )
    sim: SimConfig = SimConfig()
    kv_events: KvEventsConfig | None = Field(
        default=None,
        description="Precise mode: where this pool's engines publish vLLM KV events "
        "(--kv-events-config). `cachelane sim --config` publishes there too.",
    )
    tokenizer: TokenizerConfig | None = Field(
        default=None,
        description="Precise mode: the served model's tokenizer and chat template, so the "
        "gateway hashes the engine's own token ids.",
    )

    api_key: SecretStr | None = Field(
        default=None,
        description="The key the pool's replicas require (vLLM `--api-key`, or an "
        "authenticating proxy in front of the engine), sent as `Authorization: Bearer` on "
        "every call the gateway makes to them: proxied requests, health checks (/v1/models), "
        "metrics scrapes and warms. Give it as api_key_file or ${VAR}; it is never logged.",
    )
    forward_headers: list[str] = Field(
        default_factory=list,
        description="Client request headers passed on to the pool's replicas as they came "
        "(e.g. [openai-organization, x-user-id]); every other client header stays in the "
        "gateway. Names the gateway sets itself, hop-by-hop headers and credentials cannot "
        "be listed.",
    )

    @field_validator("forward_headers")
    @classmethod
    def _forwardable(cls, names: list[str]) -> list[str]:
        return [forwardable(name) for name in names]

    @model_validator(mode="before")
    @classmethod
    def _priority_policy_with_engine_priority(cls, data: object) -> object:
        """Each implies the other unless the config says otherwise: engine_priority needs
        engines run with --scheduling-policy priority (a pool that says fcfs with it is
        refused by _check_engine); engines that schedule by priority are sent it, or the
        critical class would queue behind standard work in the engines' waiting queues (on the
        pinned-pool arm of python -m loadtest.bench.critical, seeds 1-3: overall TTFT p99
        1.07x, 1.01x, 1.17x no tenants without it, 0.98x, 1.05x, 1.03x with it;
        docs/critical.md)."""
        if not isinstance(data, dict):
            return data
        engine = data.get("engine") or {}
        if isinstance(engine, dict):
            declared = engine.get("scheduling_policy")
        else:  # an EngineConfig built in code: its policy is set
            declared = getattr(engine, "scheduling_policy", None)
        if data.get("engine_priority") is True and declared is None:
            return {**data, "engine": {**engine, "scheduling_policy": "priority"}}
        if "engine_priority" not in data and declared == "priority":
            return {**data, "engine_priority": True}
        return data

    @model_validator(mode="after")
    def _replicas_or_discovery(self) -> PoolConfig:
        if bool(self.replicas) == (self.discovery is not None):
            raise ValueError(f"pool {self.name!r}: give exactly one of replicas, discovery")
        return self

    @model_validator(mode="after")
    def _check_engine(self) -> PoolConfig:
        if self.engine_priority and self.engine.scheduling_policy != "priority":
            raise ValueError(
                f"pool {self.name!r}: engine.scheduling_policy is "
                f"{self.engine.scheduling_policy!r} but engine_priority sends vLLM's `priority` "
                "field, which vLLM rejects unless the engine runs --scheduling-policy priority"
            )
        return self


class RemoteTierConfig(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # never routing's ANY_HOLDER, "*"
    url: HttpUrl | None = None  # the simulator's remote tier service; real tiers are engine-side
    capacity_tokens: PositiveInt = 10_000_000
