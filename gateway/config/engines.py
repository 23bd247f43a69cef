"""A pool's engine: its cost constants, scheduler settings, KV events, tokenizer, the simulator's
knobs and remote-tier admission."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from gateway.config.base import (
    _ZMQ_TCP,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Strict,
    url_key,
)
from routing.cost import (
    FIXED_S,
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


class CostsConfig(Strict):
    kv_bytes_per_token: PositiveInt = KV_BYTES_PER_TOKEN
    prefill_tokens_per_s: PositiveFloat = PREFILL_TOKENS_PER_S
    pcie_gbps: PositiveFloat = PCIE_GBPS
    remote_gbps: PositiveFloat = REMOTE_GBPS
    remote_fixed_s: NonNegativeFloat = REMOTE_FIXED_S
    fixed_s: NonNegativeFloat = FIXED_S
    step_s: NonNegativeFloat = Field(
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
    long_prefill_token_threshold: NonNegativeInt = Field(
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
            by_url = {url_key(k): v for k, v in table.items()}
            return by_url.get(url_key(url))
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
    scheduling_policy: Literal["fcfs", "priority"] | None = None  # None: the pool's engine's


class AdmissionConfig(Strict):
    """Per-replica admission cap of a pinned pool: above it, critical traffic takes the fallback."""

    max_in_flight: PositiveInt | None = None
    max_prefill_tokens: PositiveInt | None = None
