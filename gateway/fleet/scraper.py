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
from dataclasses import replace

import httpx

from gateway.fleet.engine_load import EngineLoad, parse_engine_load
from gateway.fleet.replica import Replica

log = logging.getLogger("cachelane.scraper")

__all__ = ["EngineLoad", "Scraper", "parse_engine_load"]


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
