"""What the tenant refresh costs the event loop: TenantStore.refresh() against a real Redis.

    .venv/bin/python -m loadtest.bench.tenant_refresh [--tenants N] [--rounds R]

Starts its own throwaway redis-server on loopback, writes N signed tenant records into the hash
the gateways share, then times refresh() (one HGETALL, every record parsed and its signature
checked) on a new store (the first refresh) and again on the same store (later refreshes, which
re-verify only records they have not seen). Every gateway runs one refresh a second.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from redis.asyncio import Redis

from gateway.tenancy.keys import Keyring
from gateway.tenancy.records import Record, dump
from gateway.tenancy.store import TenantStore
from loadtest.bench.redis_servers import RedisServer
from routing.types import TenantClass

SECRET = "bench-secret-" + "0" * 32


async def measure(tenants: int, rounds: int) -> tuple[float, float]:
    """(first, later) refresh medians in seconds."""
    keyring = Keyring(SECRET)
    with RedisServer() as server:
        client = Redis.from_url(server.url)
        try:
            records = {
                f"t{i}": dump(
                    Record(
                        f"t{i}",
                        keyring.digest(f"key-{i:036d}"),
                        TenantClass.STANDARD,
                        None,
                        1.0 + i,
                    ),
                    keyring,
                )
                for i in range(tenants)
            }
            async with client.pipeline(transaction=False) as pipe:
                for name, value in records.items():
                    pipe.hset("cl:tenants", name, value)
                await pipe.execute()
            first, later = [], []
            for _ in range(rounds):
                store = TenantStore([], keyring, redis=client)
                started = time.perf_counter()
                await store.refresh()
                first.append(time.perf_counter() - started)
                for _ in range(rounds):
                    started = time.perf_counter()
                    await store.refresh()
                    later.append(time.perf_counter() - started)
            assert len(store.list()) == tenants
        finally:
            await client.aclose()
    return statistics.median(first), statistics.median(later)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tenants", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for n in args.tenants:
        first, later = asyncio.run(measure(n, args.rounds))
        print(f"{n:>6} tenants: first refresh {first * 1000:7.1f} ms, later {later * 1000:7.1f} ms")


if __name__ == "__main__":
    main()
