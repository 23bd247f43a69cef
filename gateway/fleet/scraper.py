"""Engine load signals: scrape each replica's Prometheus metrics (vLLM's names) on an interval.

A gateway only knows the requests it sent itself; with several gateways (or clients that go
direct) the engine's own counters are the truth. A scrape older than `stale_after_s` is ignored,
so a replica that stops answering /metrics falls back to the gateway's own counts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import httpx
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from gateway.fleet.registry import Replica

log = logging.getLogger("cachelane.scraper")

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


class Scraper:
    def __init__(
        self,
        client: httpx.AsyncClient,
        replicas: Collection[Replica],
        *,
        interval_s: float,
        timeout_s: float,
        stale_after_s: float,
        block_size_tokens: int | None = None,
    ) -> None:
        self._block_size = block_size_tokens  # the routing's, to compare with the engines'
        self._client = client
        self._replicas = replicas  # a live view (the registry's): replicas come and go
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self.stale_after_s = stale_after_s

    async def scrape(self, replica: Replica) -> None:
        try:
            resp = await self._client.get(
                f"{replica.url}/metrics", timeout=self._timeout_s, headers=replica.auth_headers
            )
            resp.raise_for_status()
            scraped = replace(
                parse_engine_load(resp.text, time.monotonic()),
                own_waiting=replica.awaiting_first_byte,
            )
            replica.observe_engine(scraped, self._block_size)
        except (httpx.HTTPError, ValueError) as err:
            log.debug("metrics scrape of %s failed: %r", replica.name, err)

    async def scrape_all(self) -> None:
        await asyncio.gather(*[self.scrape(r) for r in self._replicas if r.healthy])

    async def run(self) -> None:
        while True:
            await self.scrape_all()
            await asyncio.sleep(self._interval_s)
