"""What a rate-limit check costs a request: RateLimiter (gateway/tenancy/rate_limits.py) in memory
and against a real redis-server on loopback.

    .venv/bin/python -m loadtest.bench.rate_limits [--requests N]

Each request is checked as the gateway checks it with both limits set: one request spent before
its body is read, its prompt's tokens after planning (so two Redis round trips). The limits are
high enough that nothing is refused. Starts its own throwaway redis-server.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from redis.asyncio import Redis

from gateway.config import RateLimitsConfig
from gateway.telemetry.metrics import Metrics
from gateway.tenancy.rate_limits import RateLimiter
from gateway.tenancy.tenants import Tenant
from loadtest.bench.redis_servers import RedisServer
from routing.types import TenantClass

LIMITS = {"standard": {"requests_per_min": 10**9, "tokens_per_min": 10**12}}
PROMPT_TOKENS = 500


async def measure(limiter: RateLimiter, requests: int) -> tuple[float, float]:
    """(median, p99) of one request's checks, in microseconds."""
    tenant = Tenant("bench", TenantClass.STANDARD)
    samples = []
    for _ in range(requests):
        started = time.perf_counter()
        await limiter.admit_request(tenant)
        await limiter.admit_tokens(tenant, PROMPT_TOKENS)
        samples.append(time.perf_counter() - started)
    samples.sort()
    return statistics.median(samples) * 1e6, samples[int(len(samples) * 0.99)] * 1e6


async def main(requests: int) -> None:
    config = RateLimitsConfig.model_validate({"classes": LIMITS})
    print(f"| limiter | median (us) | p99 (us) |  ({requests} requests)")
    print("| --- | --- | --- |")
    median, p99 = await measure(RateLimiter(config, Metrics()), requests)
    print(f"| memory | {median:.1f} | {p99:.1f} |")
    server = RedisServer().start()
    try:
        redis = Redis.from_url(server.url)
        median, p99 = await measure(RateLimiter(config, Metrics(), redis=redis), requests)
        print(f"| redis (loopback) | {median:.1f} | {p99:.1f} |")
        await redis.aclose()
    finally:
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    asyncio.run(main(parser.parse_args().requests))
