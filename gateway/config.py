"""The gateway's YAML config, validated at start-up.

Every model forbids unknown keys, so a typo fails loudly with the key's path instead of
silently falling back to a default. Cost constants default to routing/cost.py (sources there).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    HttpUrl,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from gateway import config_env
from gateway.extras import OTEL_MODULES, PRECISE_MODULES, missing_message, missing_modules
from gateway.fleet import replica_auth
from gateway.http.body import DEFAULT_MAX_JSON_DEPTH, DEFAULT_MAX_NUMBER_CHARS, MAX_JSON_DEPTH_LIMIT
from gateway.http.body_fields import ENGINE_CONTROL_FIELDS
from gateway.tenancy.example_keys import example_keys_in
from gateway.tenancy.keys import MIN_API_KEY_CHARS, MIN_SECRET_CHARS, sha256_hex
from gateway.tenancy.tenants import name_key, name_problem
from routing.cost import (
    FIXED_S,
    HBM_CAPACITY_TOKENS,
    KV_BYTES_PER_TOKEN,
    LONG_PREFILL_TOKEN_THRESHOLD,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    PCIE_GBPS,
    PREFILL_TOKENS_PER_S,
    REMOTE_FIXED_S,
    REMOTE_GBPS,
    SCHEDULING_POLICY,
    STEP_S,
    EngineSettings,
    PoolCosts,
    SchedulingPolicy,
)
from routing.decide import Policy
from routing.filters import Fallback
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS
from routing.index import DEFAULT_TTL_S
from routing.types import TenantClass

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

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# 8 MiB: a 128k-token prompt is ~512 KiB of text; the rest is headroom for base64 images.

_ZMQ_TCP = re.compile(r"^tcp://[^:/\s]+:\d{1,5}$")

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
    fixed_s: Annotated[float, Field(ge=0)] = FIXED_S
    step_s: Annotated[float, Field(ge=0)] = Field(
        default=STEP_S,
        description="Fixed cost of one engine step (a forward pass), seconds, whatever its "
        "tokens: 3.4 ms, the weights of an 8B BF16 model read once from H200 HBM "
        "(routing/cost.py). With routing.calibration: fit it seeds the fitted per-step cost.",
    )

    def to_pool_costs(self, engine: EngineConfig | None = None) -> PoolCosts:
        settings = (engine or EngineConfig()).to_settings()
        return PoolCosts(**self.model_dump(), engine=settings)


class EngineConfig(Strict):
    """The pool's engine scheduler flags, named and defaulted as vLLM's (vLLM 0.32.0 for the
    OpenAI server on an H100/H200; sources in routing/cost.py). The cost model schedules each
    replica's prefill by them; start the engines with the same flags."""

    max_num_batched_tokens: PositiveInt = Field(
        default=MAX_NUM_BATCHED_TOKENS,
        description="vLLM --max-num-batched-tokens: the token budget of one engine step, shared "
        "by running decodes (1 token each) and prefill chunks. 8192: vLLM's default for the "
        "OpenAI server on a 70-160 GiB GPU other than an A100 (vllm/engine/arg_utils.py; CPU: "
        "2048, other GPUs: 2048, >= 160 GiB: 16384).",
    )
    long_prefill_token_threshold: Annotated[int, Field(ge=0)] = Field(
        default=LONG_PREFILL_TOKEN_THRESHOLD,
        description="vLLM --long-prefill-token-threshold: most tokens one prefill takes in a "
        "step when other requests are there. 0 (vLLM's default): no cap, so a request that "
        "arrives behind a long prefill waits for all of it.",
    )
    scheduling_policy: SchedulingPolicy = Field(
        default=SCHEDULING_POLICY,
        description="vLLM --scheduling-policy: fcfs (vLLM's default) or priority (waiting "
        "requests by their `priority`, lower first, then arrival). Unset with "
        "engine_priority: true, priority.",
    )
    max_num_seqs: PositiveInt = Field(
        default=MAX_NUM_SEQS,
        description="vLLM --max-num-seqs: requests running at once (1024: vLLM's default on an "
        "H100/H200 OpenAI server; CPU: 128). Bounds the decodes that share a step.",
    )

    def to_settings(self) -> EngineSettings:
        return EngineSettings(**self.model_dump())


class KvEventsConfig(Strict):
    """Where each replica of a pool publishes vLLM's KV events (precise mode).

    Give `endpoints` (replica URL -> "tcp://HOST:PORT") or `port_offset` (the replica's own host,
    its HTTP port + offset); the replay socket (optional) likewise. vLLM binds its side with
    `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
    "endpoint": "tcp://*:PORT", "replay_endpoint": "tcp://*:PORT2"}'`.
    """

    endpoints: dict[str, str] | None = Field(
        default=None,
        description="Replica URL -> the ZMQ endpoint its engine publishes KV events on "
        "(tcp://HOST:PORT). One of endpoints, port_offset.",
    )
    port_offset: int | None = Field(
        default=None,
        description="Instead of endpoints: tcp://<replica host>:<replica port + port_offset>.",
    )
    replay_endpoints: dict[str, str] | None = Field(
        default=None,
        description="Replica URL -> the engine's replay (ROUTER) endpoint; optional. After a gap "
        "in the event sequence the missing batches are asked for there.",
    )
    replay_port_offset: int | None = Field(
        default=None, description="Instead of replay_endpoints: replica port + this offset."
    )
    topic: str = Field(
        default="", description="ZMQ topic the engines publish on (vLLM's default is empty)."
    )

    @model_validator(mode="after")
    def _one_rule(self) -> KvEventsConfig:
        if (self.endpoints is None) == (self.port_offset is None):
            raise ValueError("give exactly one of endpoints (URL -> tcp://HOST:PORT), port_offset")
        if self.replay_endpoints is not None and self.replay_port_offset is not None:
            raise ValueError("give at most one of replay_endpoints, replay_port_offset")
        for name in ("endpoints", "replay_endpoints"):
            for url, endpoint in (getattr(self, name) or {}).items():
                if not _ZMQ_TCP.match(endpoint):
                    raise ValueError(f"{name}[{url!r}]: {endpoint!r} is not tcp://HOST:PORT")
        return self

    def endpoint_for(self, replica_url: str) -> str:
        return self._resolve(replica_url, self.endpoints, self.port_offset) or ""

    def replay_endpoint_for(self, replica_url: str) -> str | None:
        return self._resolve(replica_url, self.replay_endpoints, self.replay_port_offset)

    @staticmethod
    def _resolve(url: str, table: dict[str, str] | None, offset: int | None) -> str | None:
        if table is not None:
            by_url = {_url_key(k): v for k, v in table.items()}
            return by_url.get(_url_key(url))
        if offset is None:
            return None
        parsed = urlsplit(url)
        return f"tcp://{parsed.hostname}:{(parsed.port or 80) + offset}"


class TokenizerConfig(Strict):
    """The model's tokenizer, for precise mode: the engine's token ids are hashed, not text."""

    path: str = Field(description="A local tokenizer.json (HF tokenizers format) of the model.")
    chat_template: str | None = Field(
        default=None,
        description="The model's chat template: a jinja2 file, or the template inline. Needed "
        "for /v1/chat/completions in precise mode.",
    )
    bos_token: str | None = Field(
        default=None, description="bos_token passed to the chat template (tokenizer_config.json)."
    )
    eos_token: str | None = Field(
        default=None, description="eos_token passed to the chat template (tokenizer_config.json)."
    )

    @model_validator(mode="after")
    def _files_exist(self) -> TokenizerConfig:
        if not Path(self.path).is_file():
            raise ValueError(f"path: {self.path!r} is not a file (a tokenizer.json is needed)")
        template = self.chat_template
        inline = template is not None and ("{{" in template or "{%" in template)
        if template and not inline and not Path(template).is_file():
            raise ValueError(f"chat_template: {template!r} is not a file nor an inline template")
        return self


class SimConfig(Strict):
    """Read only by `cachelane sim --config`: how the simulator behaves for this pool."""

    itl_s: PositiveFloat | None = None
    time_factor: PositiveFloat = 1.0
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"  # vLLM's --scheduling-policy default


class AdmissionConfig(Strict):
    """Per-replica admission cap of a pinned pool: above it, critical traffic takes the fallback."""

    max_in_flight: PositiveInt | None = None
    max_prefill_tokens: PositiveInt | None = None


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
    lend_max_prefill_tokens: PositiveInt | None = Field(
        default=None,
        description="A pinned pool lends a replica only to a request with at most this many "
        "uncached tokens to prefill. A started prefill is not interrupted, even by a "
        "higher engine priority, so a long lent prefill is the next critical request's wait. "
        "Unset: no bound.",
    )
    lend_keep_idle: Annotated[int, Field(ge=0)] = Field(
        default=0,
        description="A pinned replica is lent only while at least this many other replicas of "
        "its pool have no prefill pending, so the next critical request finds one it can start "
        "on at once. 0: no such reserve.",
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
        "charges a placement the wait it adds to the less urgent requests it overtakes.",
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
    cpu_capacity_tokens: Annotated[int, Field(ge=0)] = 0  # 0: no CPU offload tier
    remote_tier: str | None = None
    max_prompt_tokens: PositiveInt | None = None
    first_byte_timeout_s: PositiveFloat = Field(
        default=DEFAULT_FIRST_BYTE_TIMEOUT_S,
        description="Longest wait for the first byte of a streamed answer (its first token). "
        "Past it the request is cancelled on that replica and sent to the next one, and the "
        "replica counts a failure (health.eject_after_errors). A whole (non-streamed) answer "
        "gets this plus its max_tokens at min_decode_tokens_per_s.",
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
        return [replica_auth.forwardable(name) for name in names]

    @model_validator(mode="before")
    @classmethod
    def _priority_policy_with_engine_priority(cls, data: object) -> object:
        """engine_priority needs engines run with --scheduling-policy priority: that is the
        engine's policy unless the config says otherwise (then _check_engine rejects it)."""
        if isinstance(data, dict) and data.get("engine_priority") is True:
            engine = data.get("engine")
            if engine is None or (isinstance(engine, dict) and "scheduling_policy" not in engine):
                return {**data, "engine": {**(engine or {}), "scheduling_policy": "priority"}}
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
    eject_after_errors: Annotated[int, Field(ge=0)] = Field(
        default=DEFAULT_EJECT_AFTER_ERRORS,
        description="Passive health: consecutive failures of a replica's own traffic (5xx "
        "answers, first-byte timeouts, broken connections, answers that are not JSON or an "
        "event stream) before it is ejected (Envoy's outlier detection, consecutive_5xx). A "
        "refused connection ejects at once. 0: off.",
    )
    ejection_s: Annotated[float, Field(ge=0)] = Field(
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
    max_ejection_s: Annotated[float, Field(ge=0)] = Field(
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

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        problem = name_problem(name)
        if problem is not None:
            raise ValueError(f"tenant name {name!a} {problem} (gateway/tenancy/tenants.py)")
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


class CriticalConfig(Strict):
    fallback: Fallback = Fallback.SPILL  # when the pinned pool is down or over its cap
    retry_after_s: PositiveInt = 1
    placement: Literal["pinned_first", "cost"] = Field(
        default="cost",
        description="`cost` (the default with `fallback: spill`): every pinned and shared "
        "replica is a candidate and the cost model picks, preferring the best pinned replica "
        "while its cost is within 25% of the best (routing/pipeline.py PINNED_CLOSE), so a "
        "follow-up goes where its context is, in whichever pool; the admission cap then only "
        "governs lending. `pinned_first` (the default with `fallback: reject`): critical "
        "requests use the pinned replicas under their admission cap, and the shared pools only "
        "when none is (or, with `classes.critical.ttft_budget_ms`, when the pinned estimate is "
        "over it).",
    )
    clear_while_loading: bool = Field(
        default=False,
        description="While a critical request loads its KV (CPU swap-in, remote fetch) before it "
        "joins its replica's prefill queue, standard and batch requests that would start "
        "their prefill there first go to another candidate: a started prefill is not "
        "interrupted, even by engine priority, so it would be the critical request's wait.",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_placement(cls, data: Any) -> Any:
        """No placement given: `cost`, but with `fallback: reject` the pinned pool is a wall,
        not a preference: `pinned_first`."""
        if isinstance(data, dict) and "placement" not in data:
            reject = str(data.get("fallback", Fallback.SPILL.value)) == Fallback.REJECT.value
            return {**data, "placement": "pinned_first" if reject else "cost"}
        return data

    @model_validator(mode="after")
    def _cost_needs_spill(self) -> CriticalConfig:
        if self.placement == "cost" and self.fallback is not Fallback.SPILL:
            raise ValueError("critical.placement: cost needs critical.fallback: spill")
        return self


MAX_TTFT_SLO_MS = 600_000.0
# 10 minutes: past any first-byte timeout a pool may have (pools[].first_byte_timeout_s), so a
# larger objective can only be a unit mistake (seconds given as ms, or a timestamp).


class ClassConfig(Strict):
    """Flow control for one tenant class (gateway/serving/flow.py)."""

    ttft_budget_ms: PositiveFloat | None = Field(
        default=None,
        description="Dispatch a request while some eligible replica's estimated TTFT is within "
        "this budget (or its prefill queue is empty); otherwise hold it in the gateway, in its "
        "class's queue, until one is. Unset: never held.",
    )
    max_wait_s: PositiveFloat = Field(
        default=30.0,
        description="Longest a request waits in the gateway's queue; then 503 with Retry-After.",
    )
    max_queue: Annotated[int, Field(ge=0)] = Field(
        default=1024,
        description="Requests of the class the gateway holds at most; past it, 503 at once.",
    )
    ttft_slo_ms: Annotated[float, Field(gt=0, le=MAX_TTFT_SLO_MS)] | None = Field(
        default=None,
        description="The class's TTFT objective, for requests that state none (header "
        "`x-slo-ttft-ms`): each is placed where its estimate meets it with the least harm to "
        "others, a batch request that cannot be is shed (503 with Retry-After), and "
        "attainment is counted (cachelane_slo_attained_total). Unset: no objective.",
    )


class ClassesConfig(Strict):
    """Per-class flow control; classes are served critical first, then standard, then batch,
    round robin between the tenants of a class."""

    critical: ClassConfig = ClassConfig(max_wait_s=10.0)
    standard: ClassConfig = ClassConfig(ttft_budget_ms=1000.0, max_wait_s=30.0)
    # 1 s of estimated TTFT: enough queued prefill to keep an engine's batches full (a busy 8B
    # replica prefills ~30k tokens in that time, routing/cost.py), short enough that a critical
    # request dispatched past the held ones waits for little.
    batch: ClassConfig = ClassConfig(ttft_budget_ms=500.0, max_wait_s=60.0)
    # batch holds back sooner than standard, so standard is dispatched first under load.


class FlowControlConfig(Strict):
    enabled: bool = Field(
        default=True,
        description="Hold requests in per-class queues in the gateway when every replica's "
        "estimated TTFT is over the class's budget (classes.*), instead of piling them onto "
        "the engines' queues.",
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
        description="Limits of every tenant of a class (the class the request is served at), "
        "each {requests_per_min, tokens_per_min}, e.g. {standard: {requests_per_min: 600, "
        "tokens_per_min: 1000000}}; unset: no limit of that kind. Each tenant has its own "
        "budget. Tokens: the prompt's estimate at admission, corrected by the engine's "
        "usage.total_tokens (prompt and completion) when the answer reports it.",
    )
    tenants: dict[str, RateLimit] = Field(
        default_factory=dict,
        description="Limits of one tenant by name; a limit given here replaces its class's.",
    )
    failed_auth_per_min: Annotated[int, Field(ge=0)] = Field(
        default=DEFAULT_FAILED_AUTH_PER_MIN,
        description="Failed authentications (401) a client address, or a key, may make a "
        "minute; past it, its requests without a valid key get 429 with Retry-After until the "
        "minute allows more. A valid key is never refused by this limit. Behind a load "
        "balancer set listen.forwarded_allow_ips to its addresses (the client's is then taken "
        "from X-Forwarded-For), or every client without a key shares its address. 0: no limit.",
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
        "-est-terms-ms, -expected-cached-tokens), with the same choices as decision_headers.",
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


class TracingConfig(Strict):
    """OpenTelemetry spans, one per request (gateway/telemetry/tracing.py; the [otel] extra)."""

    enabled: bool = Field(
        default=False,
        description="Trace every request: a span with the routing decision and its outcome, "
        "continuing the client's W3C traceparent and sending its own to the replica. Needs the "
        "[otel] extra.",
    )
    endpoint: str | None = Field(
        default=None,
        description="OTLP/HTTP traces URL, e.g. http://otel-collector:4318/v1/traces; unset: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else http://localhost:4318/v1/traces (the OTLP "
        "exporter's defaults; OTEL_EXPORTER_OTLP_HEADERS adds headers such as a token).",
    )
    service_name: str = Field(
        default="cachelane", min_length=1, description="The spans' service.name resource."
    )
    sample_ratio: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Share of new traces sampled (1.0: every one, the OpenTelemetry SDK's "
        "default sampler). A trace whose traceparent says sampled is always sampled.",
    )

    @model_validator(mode="after")
    def _check_installed(self) -> TracingConfig:
        missing = missing_modules(OTEL_MODULES) if self.enabled else []
        if missing:
            raise ValueError(missing_message("tracing", "otel", missing))
        return self


DEFAULT_CAPTURE_MAX_BYTES = 256 * 1024 * 1024
# 256 MiB: a request is ~20 bytes per 16-token block (its hash in hex) plus ~600 bytes of fields,
# ~7 KB for a 6k-token prompt, so ~35k long requests: an hour at 10 requests/s.
DEFAULT_CAPTURE_MAX_RECORDS = 1_000_000
# Bounds a capture of short prompts (~1 KB each): max_bytes stops it first for long ones.


class CaptureConfig(Strict):
    """Opt-in traffic capture for `cachelane plan` (gateway/accounting/capture.py; format:
    routing/whatif/capture.py)."""

    path: str | None = Field(
        default=None,
        description="Write one JSON line per answered request to this file: the prompt's block "
        "hashes and token counts, arrival time, tenant, class, model, pool, replica, observed "
        "TTFT, cached tokens and the tier of the hit; never prompt text. Unset: no capture. "
        "A file already there is moved to PATH.1.",
    )
    max_bytes: PositiveInt = Field(
        default=DEFAULT_CAPTURE_MAX_BYTES,
        description="The capture stops (later requests are counted as dropped in "
        "cachelane_capture_records_total) when its next line would pass this size. 256 MiB: "
        "~35k requests of 6k-token prompts.",
    )
    max_records: PositiveInt = Field(
        default=DEFAULT_CAPTURE_MAX_RECORDS,
        description="The capture stops after this many requests.",
    )


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
        folded: dict[str, int] = {}
        for i, name in enumerate(tenant_names):
            first = folded.setdefault(name_key(name), i)
            if first != i:
                raise ValueError(
                    f"tenants.{i}.name: {name!a} is the same name as tenants.{first}.name "
                    f"{tenant_names[first]!a} (names are compared case- and width-folded, "
                    "gateway/tenancy/tenants.py)"
                )
        _check_auth(self)
        _check_exposure(self)
        urls = [str(u) for p in self.pools for u in p.replicas]
        if len(set(urls)) != len(urls):
            raise ValueError("pools: a replica URL appears twice")
        if self.routing.mode == "precise":
            _check_precise(self.pools)
        return self


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
    missing = missing_modules(PRECISE_MODULES)
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
            urls = {_url_key(str(u)) for u in pool.replicas}
            given = {_url_key(u) for u in pool.kv_events.endpoints}
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


def _url_key(url: str) -> str:
    return url.rstrip("/")


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


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> GatewayConfig:
    """Read, resolve (`${VAR}`, `*_file` secrets: gateway/config_env.py) and validate a config."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read config {p}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{p} is not valid YAML: {err}") from None
    try:
        data = config_env.resolve(data, os.environ if env is None else env)
    except config_env.EnvError as err:
        raise ConfigError(f"{p}: {err}") from None
    return parse_config(data, str(p))


def quick_config(
    replica_urls: list[str], *, policy: Policy = Policy.CACHE_AWARE, host: str, port: int
) -> GatewayConfig:
    """Config for `cachelane serve --replicas ...`: one pool, defaults everywhere, auth open."""
    return parse_config(
        {
            "listen": {"host": host, "port": port},
            "routing": {"policy": policy.value},
            "auth": {"mode": "open"},  # a quick start: no tenants, so no keys to check
            # a quick start shows every client why it went where it went
            "exposure": {"decision_headers": "all", "estimate_headers": "all"},
            "pools": [{"name": "default", "replicas": replica_urls}],
        },
        "--replicas",
    )
