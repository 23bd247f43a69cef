"""The shared remote KV tier (think LMCache server or Mooncake store) and the replicas' client.

The service only tracks which blocks it holds (an LRU with a capacity), never their bytes; what a
transfer costs in time is the engine's business (engine.py). The client never fails a request: a
remote tier that cannot be reached counts as holding nothing, as an LMCache backend would.

  POST /lookup   how many leading blocks it holds (LMCache's `contains`); refreshes them
  POST /fetch    the engine read these blocks (LMCache's `retrieve`): they count as read
  POST /store    write blocks; the tier keeps the new ones
Its counters say which stored blocks were evicted without ever being fetched (the ground truth
of the gateway's "written, never read" estimate, gateway/accounting/ledger.py).
"""

from __future__ import annotations

import logging

import httpx
from fastapi import FastAPI, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from pydantic import BaseModel

from loadtest.sim.config import RemoteTierSpec
from loadtest.sim.tiers import BlockLRU

log = logging.getLogger(__name__)

REMOTE_TIMEOUT_S = 5.0  # a loopback call; anything slower means the service is wedged


class Blocks(BaseModel):
    hashes: list[int]
    namespace: str | None = None  # informational: the hashes are already namespaced (hashing.py)


def create_remote_app(spec: RemoteTierSpec) -> FastAPI:
    """The remote tier service: POST /lookup, /store, /reset; GET /health, /metrics."""
    blocks = BlockLRU(spec.capacity_tokens // spec.block_size_tokens)
    registry = CollectorRegistry()
    held = Gauge("cachelane_sim_remote_tier_blocks", "Blocks held", registry=registry)
    held.set_function(lambda: len(blocks))
    Gauge("cachelane_sim_remote_tier_capacity_blocks", "Capacity in blocks", registry=registry).set(
        blocks.capacity_blocks
    )
    lookups = Counter("cachelane_sim_remote_tier_lookups", "Lookups", registry=registry)
    hit_blocks = Counter(
        "cachelane_sim_remote_tier_hit_blocks", "Leading blocks found by lookups", registry=registry
    )
    stored = Counter(
        "cachelane_sim_remote_tier_stored_blocks", "Blocks newly stored", registry=registry
    )
    evicted = Counter(
        "cachelane_sim_remote_tier_evicted_blocks", "Blocks evicted", registry=registry
    )
    fetched = Counter(
        "cachelane_sim_remote_tier_fetched_blocks", "Blocks fetched by replicas", registry=registry
    )
    evicted_unread = Counter(
        "cachelane_sim_remote_tier_evicted_unread_blocks",
        "Blocks evicted that no replica fetched since they were stored",
        registry=registry,
    )
    read: set[int] = set()  # held blocks fetched since they were stored

    app = FastAPI(title=f"cachelane sim remote tier {spec.name}")

    @app.post("/lookup")
    async def lookup(body: Blocks) -> dict[str, int]:
        n = blocks.prefix_len(body.hashes)
        blocks.touch(reversed(body.hashes[:n]))
        lookups.inc()
        hit_blocks.inc(n)
        return {"prefix_blocks": n}

    @app.post("/fetch")
    async def fetch(body: Blocks) -> dict[str, int]:
        held = [h for h in body.hashes if h in blocks]
        read.update(held)
        fetched.inc(len(held))
        return {"fetched_blocks": len(held)}

    @app.post("/store")
    async def store(body: Blocks) -> dict[str, int]:
        new = sum(1 for h in body.hashes if h not in blocks)
        # Reversed, so the prefix is the most recent and a prompt's tail is evicted first.
        gone = blocks.insert(reversed(body.hashes))
        stored.inc(new)
        evicted.inc(len(gone))
        unread = [h for h in gone if h not in read]
        evicted_unread.inc(len(unread))
        read.difference_update(gone)
        return {"stored_blocks": new}

    @app.post("/reset")
    async def reset() -> Response:
        blocks.clear()
        read.clear()
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


class RemoteClient:
    """A replica's connection to the remote tier; the caller owns the httpx client."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self._http = http
        self.errors = 0

    async def lookup(self, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` the remote tier holds (0 if it cannot be reached)."""
        if not hashes:
            return 0
        body = await self._post("/lookup", hashes)
        return int(body.get("prefix_blocks", 0)) if body else 0

    async def fetch(self, hashes: list[int]) -> int:
        """Report a read of these blocks; returns how many the tier held (0 if unreachable)."""
        if not hashes:
            return 0
        body = await self._post("/fetch", hashes)
        return int(body.get("fetched_blocks", 0)) if body else 0

    async def store(self, hashes: list[int]) -> int:
        """Write blocks; returns how many the tier did not hold yet (0 if it cannot be reached)."""
        if not hashes:
            return 0
        body = await self._post("/store", hashes)
        return int(body.get("stored_blocks", 0)) if body else 0

    async def _post(self, path: str, hashes: list[int]) -> dict[str, int] | None:
        try:
            response = await self._http.post(path, json={"hashes": hashes})
            response.raise_for_status()
            body: dict[str, int] = response.json()
            return body
        except (httpx.HTTPError, ValueError) as err:
            self.errors += 1
            log.warning("remote tier %s%s failed: %r", self._http.base_url, path, err)
            return None
