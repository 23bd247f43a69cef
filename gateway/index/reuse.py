"""Prefix-family reuse counts for remote-tier admission: in memory, or in Redis so that every
gateway counts every request. Redis keys of one family share a hash tag, so the read of a whole
window is a single-slot MGET on Redis Cluster; one pipelined round trip per request.
With Redis down, the local window (always kept) answers and the failure is counted."""

from __future__ import annotations

import logging
import time
from typing import Any

from gateway.telemetry.metrics import Metrics
from routing.admission import DEFAULT_WINDOW_S, WINDOW_BUCKETS, ReuseWindow

log = logging.getLogger("cachelane.reuse")


class ReuseCounter:
    def __init__(
        self,
        metrics: Metrics,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        redis: Any | None = None,
        key_prefix: str = "cl",
    ) -> None:
        self._local = ReuseWindow(window_s)
        self._window_s = window_s
        self._redis = redis
        self._prefix = key_prefix
        self._metrics = metrics

    def _keys(self, family: int, bucket: int) -> list[str]:
        return [
            f"{self._prefix}:reuse:{{{family:016x}}}:{b}"
            for b in range(bucket - WINDOW_BUCKETS + 1, bucket + 1)
        ]

    async def seen(self, family: int) -> int:
        """Count one request of `family`; return the earlier requests in the window."""
        now_s = time.time()
        local = self._local.seen(family, now_s)
        if self._redis is None:
            return local
        keys = self._keys(family, self._local.bucket(now_s))
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.mget(keys[:-1])
            pipe.incr(keys[-1])
            pipe.pexpire(keys[-1], int(self._window_s * 1000) + 1000)
            older, current, _ = await pipe.execute()
        except Exception as err:
            self._metrics.index_errors.labels("reuse").inc()
            log.debug("reuse count from Redis failed, using the local window: %r", err)
            return local
        return sum(int(v) for v in older if v is not None) + int(current) - 1

    async def peek(self, family: int) -> int:
        now_s = time.time()
        if self._redis is None:
            return self._local.count(family, now_s)
        try:
            values = await self._redis.mget(self._keys(family, self._local.bucket(now_s)))
        except Exception:
            return self._local.count(family, now_s)
        return sum(int(v) for v in values if v is not None)
