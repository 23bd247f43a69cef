"""What a simulated replica and the shared remote tier are: names, ports, capacities, speeds.

The cost constants are routing.cost's defaults (PoolCosts()), so the simulator charges exactly what
the gateway's cost model expects unless a test or a demo says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from loadtest.sim.steps import (
    STEP_OVERHEAD_S,
    VLLM_LONG_PREFILL_TOKEN_THRESHOLD,
    VLLM_MAX_NUM_SEQS,
    SchedulingPolicy,
    StepSettings,
    default_max_num_batched_tokens,
)
from routing.cost import HBM_CAPACITY_TOKENS, KV_BYTES_PER_TOKEN, PoolCosts
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS

SIM_MODEL = "sim-llama-8b"

EngineModel = Literal["steps", "serial"]
# "steps": vLLM V1's step loop (steps.py), the default. "serial": one prefill at a time, whole, in
# policy order (prefill_queue.py), kept to compare with what earlier measurements assumed.

ITL_S = 0.010
# Decode is memory-bound: every step reads the weights plus the batch's KV from HBM. At a moderate
# batch of 32 requests with 8k-token contexts that is 16.1 GB + 32 * 8192 * 128 KiB = 50 GB per
# step, / 4.8 TB/s (H200 HBM3e bandwidth, NVIDIA datasheet) = ~10 ms per output token.

MAX_MODEL_LEN_TOKENS = 131_072
# Llama-3.1's context window (meta-llama/Llama-3.1-8B config.json: max_position_embeddings=131072).

REMOTE_CAPACITY_TOKENS = (1 << 40) // KV_BYTES_PER_TOKEN
# An assumed 1 TiB remote KV store (the RAM of one LMCache / Mooncake storage node): ~8.4M tokens
# of Llama-3.1-8B KV. A sizing assumption, not a measurement.


@dataclass(frozen=True, kw_only=True)
class ServerSpec:
    """A simulated server's name and where it listens."""

    name: str
    port: int
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True, kw_only=True)
class SimReplicaSpec(ServerSpec):
    model: str = SIM_MODEL
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS
    hbm_capacity_tokens: int = HBM_CAPACITY_TOKENS
    cpu_capacity_tokens: int = 0  # 0 = no CPU offload tier
    remote_url: str | None = None  # base URL of the shared remote tier service, None = no remote
    costs: PoolCosts = field(default_factory=PoolCosts)
    itl_s: float = ITL_S
    time_factor: float = 1.0  # every modelled sleep is multiplied by it (0 = no sleeps)
    max_model_len_tokens: int = MAX_MODEL_LEN_TOKENS
    # Order of the prefill queue, as vLLM's --scheduling-policy (whose default is "fcfs"); with
    # "priority" the body's "priority" (lower first) orders it, with "fcfs" a non-zero one is a 400.
    scheduling_policy: SchedulingPolicy = "fcfs"
    engine_model: EngineModel = "steps"
    # The step loop's flags, as vLLM's (steps.py gives their sources). max_num_batched_tokens None:
    # vLLM's OpenAI-server default scaled to costs.prefill_tokens_per_s (a full step lasts what
    # it lasts on an H200).
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int = VLLM_LONG_PREFILL_TOKEN_THRESHOLD
    max_num_seqs: int = VLLM_MAX_NUM_SEQS
    step_overhead_s: float = STEP_OVERHEAD_S
    # Precise mode: publish vLLM-format KV events on tcp://host:kv_events_port (replays on
    # kv_replay_port), and tokenize prompts with this tokenizer.json and chat template (a file or
    # inline) as the engine would, instead of counting characters.
    kv_events_port: int | None = None
    kv_replay_port: int | None = None
    kv_topic: str = ""
    tokenizer_path: str | None = None
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    api_key: str | None = field(default=None, repr=False)  # required of callers (sim/auth.py)

    def __post_init__(self) -> None:
        _require(self.block_size_tokens > 0, "block_size_tokens must be > 0")
        _require(
            self.hbm_capacity_tokens >= self.block_size_tokens,
            "hbm_capacity_tokens must hold at least one block",
        )
        _require(self.cpu_capacity_tokens >= 0, "cpu_capacity_tokens must be >= 0")
        _require(self.itl_s >= 0, "itl_s must be >= 0")
        _require(self.time_factor >= 0, "time_factor must be >= 0")
        _require(self.max_model_len_tokens > 0, "max_model_len_tokens must be > 0")
        _require(self.costs.prefill_tokens_per_s > 0, "costs.prefill_tokens_per_s must be > 0")
        _require(
            self.scheduling_policy in get_args(SchedulingPolicy),
            f"scheduling_policy must be one of {get_args(SchedulingPolicy)}",
        )
        _require(
            self.engine_model in get_args(EngineModel),
            f"engine_model must be one of {get_args(EngineModel)}",
        )
        self.step_settings()  # validates the step loop's flags

    def step_settings(self) -> StepSettings:
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = default_max_num_batched_tokens(self.costs.prefill_tokens_per_s)
        return StepSettings(
            prefill_tokens_per_s=self.costs.prefill_tokens_per_s,
            max_num_batched_tokens=budget,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            scheduling_policy=self.scheduling_policy,
            max_num_seqs=self.max_num_seqs,
            step_overhead_s=self.step_overhead_s,
            decode_step_s=self.itl_s,
        )


@dataclass(frozen=True, kw_only=True)
class RemoteTierSpec(ServerSpec):
    capacity_tokens: int = REMOTE_CAPACITY_TOKENS
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS

    def __post_init__(self) -> None:
        _require(self.block_size_tokens > 0, "block_size_tokens must be > 0")
        _require(self.capacity_tokens >= 0, "capacity_tokens must be >= 0")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
