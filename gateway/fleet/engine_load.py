"""What an engine's own Prometheus metrics say about its load (vLLM's names, SGLang's aliases):
the parse of one scrape, read by the registry's replicas (gateway/fleet/registry.py) and taken by
the scraper (gateway/fleet/scraper.py)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"  # labels num_gpu_blocks, block_size (vllm/v1/metrics)
# SGLang exports the same signals as sglang:num_running_reqs / sglang:num_queue_reqs.
ALIASES = {
    "sglang:num_running_reqs": RUNNING,
    "sglang:num_queue_reqs": WAITING,
    "sglang:token_usage": KV_USAGE,
}


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: float
    waiting: float
    kv_usage: float  # 0..1
    scraped_at_s: float  # time.monotonic()
    gpu_blocks: int | None = None  # KV blocks the engine allocated in HBM (cache_config_info)
    own_waiting: int = 0  # this gateway's requests awaiting their first byte when it was read
    block_size_tokens: int | None = None

    @property
    def hbm_capacity_tokens(self) -> int | None:
        if self.gpu_blocks is None or self.block_size_tokens is None:
            return None
        return self.gpu_blocks * self.block_size_tokens


def parse_engine_load(text: str, now_s: float) -> EngineLoad:
    """Sum the load gauges over every series (one per model / data-parallel rank)."""
    totals = {RUNNING: 0.0, WAITING: 0.0, KV_USAGE: 0.0}
    usage_series = 0
    gpu_blocks: int | None = None
    block_size: int | None = None
    for family in text_string_to_metric_families(text):
        name = ALIASES.get(family.name, family.name)
        if name == CACHE_CONFIG:
            # one series per engine (data-parallel rank): the replica holds their sum
            for sample in family.samples:
                blocks = _int_label(sample.labels, "num_gpu_blocks")
                size = _int_label(sample.labels, "block_size")
                if blocks is not None and size is not None:
                    gpu_blocks = (gpu_blocks or 0) + blocks
                    block_size = size
            continue
        if name not in totals:
            continue
        for sample in family.samples:
            totals[name] += sample.value
            usage_series += name == KV_USAGE
    return EngineLoad(
        running=totals[RUNNING],
        waiting=totals[WAITING],
        kv_usage=totals[KV_USAGE] / max(usage_series, 1),
        scraped_at_s=now_s,
        gpu_blocks=gpu_blocks,
        block_size_tokens=block_size,
    )


def _int_label(labels: dict[str, str], key: str) -> int | None:
    value = labels.get(key, "")
    return int(value) if value.isdigit() and int(value) > 0 else None
