"""KV events ingested per second: vLLM-format messages (real msgpack bytes) decoded, mapped to
gateway keys and applied to the index, in one process, for the memory and Redis backends.

    .venv/bin/python -m loadtest.bench.events     # ~30 s; writes results/bench_events.json

Each message is one engine step's batch as vLLM sends it: a BlockStored of `blocks_per_event`
blocks of 16 tokens (a prompt's new blocks, chained to the previous event's last block), and,
once the replica is full, a BlockRemoved per evicted block (vLLM sends one hash per event).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from gateway.engines.events import BlockRemoved, BlockStored, Event, EventBatch
from gateway.engines.feed import ReplicaFeed
from gateway.engines.vllm import encode_batch, encode_seq
from gateway.index.redis_backend import RedisIndex
from gateway.telemetry.metrics import Metrics
from loadtest.bench.redis_servers import RedisServer
from routing.index import Index, MemoryIndex

BLOCK_TOKENS = 16  # vLLM's default --block-size
CAPACITY_BLOCKS = 4096  # a replica's HBM in blocks for this run: evictions start after it fills
MAX_S = 10.0  # per cell, whatever the message count


def messages(count: int, blocks_per_event: int) -> list[list[bytes]]:
    out: list[list[bytes]] = []
    parent: int | None = None
    next_hash = 1
    live: list[int] = []
    for seq in range(count):
        hashes = tuple(range(next_hash, next_hash + blocks_per_event))
        next_hash += blocks_per_event
        tokens = tuple((h * 131 + t) % 32000 for h in hashes for t in range(BLOCK_TOKENS))
        events: list[Event] = [BlockStored(hashes, parent, tokens, BLOCK_TOKENS, "GPU")]
        parent = hashes[-1]
        live.extend(hashes)
        while len(live) > CAPACITY_BLOCKS:
            events.append(BlockRemoved((live.pop(0),), "GPU"))
        batch = EventBatch(time.time(), tuple(events), 0)
        out.append([b"", encode_seq(seq), encode_batch(batch)])
    return out


async def ingest(index: Index, frames: list[list[bytes]]) -> dict[str, float]:
    feed = ReplicaFeed(
        "bench:8000",
        model="m",
        block_size_tokens=BLOCK_TOKENS,
        capacity_blocks=CAPACITY_BLOCKS,
        index=index,
        metrics=Metrics(),
    )
    started = time.perf_counter()
    done = 0
    for f in frames:
        await feed.handle(f)
        done += 1
        if time.perf_counter() - started > MAX_S:
            break
    elapsed = time.perf_counter() - started
    return {"messages": done, "seconds": elapsed, "messages_per_s": done / elapsed}


async def run(count: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    server = RedisServer().start()
    try:
        for blocks in (1, 8, 32):
            frames = messages(count, blocks)
            mem = await ingest(MemoryIndex(), frames)
            redis = RedisIndex.from_url(server.url, socket_timeout_s=2.0)
            try:
                red = await ingest(redis, frames)
            finally:
                await redis.close()
            results[str(blocks)] = {"memory": mem, "redis": red}
    finally:
        server.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.events", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--messages", type=int, default=5000, help="messages per cell")
    parser.add_argument("--out", type=Path, default=Path("results/bench_events.json"))
    args = parser.parse_args()
    results = asyncio.run(run(args.messages))
    table = Table(
        "blocks per BlockStored",
        "memory msg/s",
        "memory blocks/s",
        "Redis msg/s",
        "Redis blocks/s",
        title="KV events ingested (decode + map + index)",
    )
    for blocks, r in results.items():
        b = int(blocks)
        table.add_row(
            blocks,
            f"{r['memory']['messages_per_s']:,.0f}",
            f"{r['memory']['messages_per_s'] * b:,.0f}",
            f"{r['redis']['messages_per_s']:,.0f}",
            f"{r['redis']['messages_per_s'] * b:,.0f}",
        )
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
