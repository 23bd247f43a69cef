"""KV index benchmark: lookup latency of each backend, and Redis memory per indexed block.

    .venv/bin/python -m loadtest.bench.index [--iterations N] [--budget-s S]

Starts its own throwaway redis-server (and a 3-master cluster) on loopback. For 1k/8k/32k-token
prompts it fills the index as 16 replicas holding different prefixes of one prompt (replica i
holds the first (i+1)/16 of it in HBM, every other replica also the whole prompt in CPU: up to 24
holders per block), then times, per backend:
  hit      `lookup` of the whole prompt (every block hits): the decision-path cost;
  short    `lookup` of a prompt that shares only its first 8 blocks (the rest are unknown): what
           fetching past the first miss costs, against a second round trip;
  record   `record` of the whole prompt at one replica that already holds it (a TTL refresh).
Memory: used_memory delta after recording distinct blocks at one location, then the same blocks at
a second location. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from rich.console import Console
from rich.table import Table

from gateway.index.redis_backend import RedisIndex
from loadtest.bench.redis_servers import RedisClusterProcs, RedisServer
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS
from routing.index import Index, MemoryIndex
from routing.types import Location, Tier
from routing.whatif.summary import percentile

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # a typical model name: its length is in every key
PROMPT_TOKENS = (1024, 8192, 32768)  # short chat, long document, long-context agent session
REPLICAS = 16  # a mid-size pool: enough holders per block to exercise multi-field hashes
ITERATIONS = 500  # timed calls per cell: enough for a stable p99 (5 samples above it)
SHORT_HIT_BLOCKS = 8  # the "short" lookup: a shared system prompt, then a prompt nobody has seen
WARMUP_ITERATIONS = 20  # connections, cluster slot map, allocator warm-up
BUDGET_S = 5.0  # wall-clock cap per cell, so a slow backend cannot stall the run
MEMORY_BLOCKS = 20_000  # used_memory noise is ~tens of kB; 20k blocks make it < 1 % per block
SOCKET_TIMEOUT_S = 2.0  # not the 0.25 s default: a busy 2-core box stalls 2048-block replies
SEED = 20240601  # fixed so runs compare
OUT_PATH = Path(__file__).resolve().parents[2] / "results" / "bench_index.json"


def replica_location(i: int, tier: Tier = Tier.HBM) -> Location:
    return Location(f"vllm-{i}", tier)


async def fill(index: Index, hashes: Sequence[int]) -> None:
    for i in range(REPLICAS):
        prefix_blocks = max(1, len(hashes) * (i + 1) // REPLICAS)
        await index.record(MODEL, hashes[:prefix_blocks], replica_location(i))
        if i % 2 == 1:
            await index.record(MODEL, hashes, replica_location(i, Tier.CPU))


async def time_calls(
    call: Callable[[], Awaitable[object]], iterations: int, budget_s: float
) -> dict[str, Any]:
    for _ in range(WARMUP_ITERATIONS):
        await call()
    samples_us: list[float] = []
    deadline = time.monotonic() + budget_s
    while len(samples_us) < iterations and time.monotonic() < deadline:
        started_ns = time.perf_counter_ns()
        await call()
        samples_us.append((time.perf_counter_ns() - started_ns) / 1000)
    return {
        "iterations": len(samples_us),
        "p50_us": round(statistics.median(samples_us), 1),
        "p99_us": round(percentile(samples_us, 99), 1),
        "mean_us": round(statistics.fmean(samples_us), 1),
    }


async def bench_lookups(
    backends: dict[str, Index], iterations: int, budget_s: float
) -> list[dict[str, Any]]:
    rng = random.Random(SEED)
    rows: list[dict[str, Any]] = []
    for tokens in PROMPT_TOKENS:
        hashes = [rng.getrandbits(64) for _ in range(tokens // DEFAULT_BLOCK_SIZE_TOKENS)]
        short = hashes[:SHORT_HIT_BLOCKS] + [rng.getrandbits(64) for _ in hashes[SHORT_HIT_BLOCKS:]]
        for name, index in backends.items():
            await fill(index, hashes)
            assert len(await index.lookup(MODEL, hashes)) == len(hashes)
            assert len(await index.lookup(MODEL, short)) == SHORT_HIT_BLOCKS
            calls: dict[str, Callable[[], Awaitable[object]]] = {
                "hit": partial(index.lookup, MODEL, hashes),
                "short": partial(index.lookup, MODEL, short),
                "record": partial(index.record, MODEL, hashes, replica_location(REPLICAS - 1)),
            }
            for op, call in calls.items():
                stats = await time_calls(call, iterations, budget_s)
                row = {"backend": name, "op": op, "prompt_tokens": tokens, "blocks": len(hashes)}
                rows.append(row | stats)
    return rows


async def used_memory_bytes(client: Redis) -> int:
    info = await client.info("memory")
    return int(info["used_memory"])


async def bench_memory(url: str) -> dict[str, Any]:
    """Redis bytes per (block, location) entry: first location, then one more on the same blocks."""
    client = Redis.from_url(url)
    index = RedisIndex.from_url(url, key_prefix="mem", socket_timeout_s=SOCKET_TIMEOUT_S)
    rng = random.Random(SEED + 1)
    hashes = [rng.getrandbits(64) for _ in range(MEMORY_BLOCKS)]
    chunk = 2048  # record in prompt-sized calls, as the gateway does
    sizes = [await used_memory_bytes(client)]
    for location in (replica_location(0), replica_location(1)):
        for start in range(0, len(hashes), chunk):
            await index.record(MODEL, hashes[start : start + chunk], location)
        sizes.append(await used_memory_bytes(client))
    await index.close()
    await client.aclose()
    return {
        "blocks": MEMORY_BLOCKS,
        "model_name_chars": len(MODEL),
        "bytes_per_block_first_location": round((sizes[1] - sizes[0]) / MEMORY_BLOCKS, 1),
        "bytes_per_block_extra_location": round((sizes[2] - sizes[1]) / MEMORY_BLOCKS, 1),
    }


def render(rows: list[dict[str, Any]], memory: dict[str, Any]) -> None:
    table = Table(title="KV index latency (16 replicas, up to 24 holders per block)")
    columns = ("backend", "op", "prompt tokens", "blocks", "n", "p50 µs", "p99 µs", "mean µs")
    for column in columns:
        table.add_column(column, justify="left" if column in ("backend", "op") else "right")
    for r in rows:
        values = (r["prompt_tokens"], r["blocks"], r["iterations"], r["p50_us"], r["p99_us"])
        table.add_row(r["backend"], r["op"], *map(str, values), str(r["mean_us"]))
    console = Console()
    console.print(table)
    console.print(
        f"Redis memory per indexed block ({memory['blocks']} blocks): "
        f"{memory['bytes_per_block_first_location']} B for the first location, "
        f"+{memory['bytes_per_block_extra_location']} B per extra location"
    )


async def run(iterations: int, budget_s: float, out_path: Path) -> None:
    with RedisServer() as server, RedisClusterProcs() as cluster:
        backends: dict[str, Index] = {
            "memory": MemoryIndex(),
            "redis": RedisIndex.from_url(
                server.url, key_prefix="bench", socket_timeout_s=SOCKET_TIMEOUT_S
            ),
            "redis_cluster": RedisIndex.from_url(
                cluster.url, cluster=True, key_prefix="bench", socket_timeout_s=SOCKET_TIMEOUT_S
            ),
        }
        rows = await bench_lookups(backends, iterations, budget_s)
        for index in backends.values():
            await index.close()
        admin = Redis.from_url(server.url)
        await admin.flushall()
        redis_version = (await admin.info("server"))["redis_version"]
        await admin.aclose()
        memory = await bench_memory(server.url)
    render(rows, memory)
    report = {"redis_version": redis_version, "lookup": rows, "redis_memory": memory}
    write_json(out_path, report)
    Console().print(f"wrote {out_path}")


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.index",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    parser.add_argument("--budget-s", type=float, default=BUDGET_S)
    parser.add_argument("--out", type=Path, default=OUT_PATH)
    args = parser.parse_args()
    asyncio.run(run(args.iterations, args.budget_s, args.out))


if __name__ == "__main__":
    main()
