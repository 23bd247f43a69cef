"""How well the pinned pool serves the critical class: live lending and an undersizing alarm.

Every routed critical request reports where it went (`served`), and, when it left the pinned
pool, whether the pool was short for it (`pressed`: a pinned replica without headroom would have
taken it with an empty queue, routing/pipeline.py). Under `critical.placement: pinned_first`,
a request that left for lack of room stops lending at once, for LEND_COOLDOWN_S: `reclaimed`.
Cost placement does not reclaim (Routed.reclaim_s 0): its estimate sees the lent work queued on
a pinned replica, and critical requests go elsewhere while it costs more there.

Over each REPORT_WINDOW_S two shares are metrics: the critical requests the pinned pools took,
and those they were short for. When the second is over SHORT_SHARE the pool is too
small for its critical demand: a warning is logged (once per window at most), and `status()`
says so, with a hint, for /ready and `cachelane report`.
"""

from __future__ import annotations

import logging
from typing import Any

from gateway.config import PoolConfig
from gateway.telemetry.metrics import Metrics
from routing.pipeline import LEND_COOLDOWN_S  # one rule for the gateway and the what-if replay

log = logging.getLogger("cachelane.pinning")

REPORT_WINDOW_S = 60.0
SHORT_SHARE = 0.2  # over 20% of critical requests found no pinned replica free: too small
MIN_REQUESTS = 20  # fewer critical requests in a window say nothing about the pool's size
UNDERSIZED_HINT = (
    "the pinned pool is too small for its critical demand: {short:.0%} of {total} critical "
    "requests in the last {window:.0f} s found no pinned replica free and were placed on the "
    "shared pools; add pinned replicas, or drop `pinned: true` and let engine priority "
    "(pools[].engine_priority) serve the critical class on the whole fleet"
)


class PinnedPoolWatch:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._reclaimed_until_s = 0.0
        self._window_start_s: float | None = None
        self._pinned = 0
        self._spilled = 0
        self._short = 0
        self.hint: str | None = None  # the last full window's verdict: None while it is fine

    def served(
        self,
        pool: PoolConfig,
        now_s: float,
        *,
        pressed: bool = True,
        reclaim_s: float = LEND_COOLDOWN_S,
    ) -> None:
        """A critical request was routed to a replica of `pool`. `pressed`: for a request off the
        pinned pool, whether the pool was short for it (with critical.placement: cost a request
        may leave it for its context's sake; that does not count); `reclaim_s`: then, for how
        long lending stops (routing/pipeline.py Routed.reclaim_s: 0 under cost placement)."""
        if self._window_start_s is None:
            self._window_start_s = now_s
        if now_s - self._window_start_s >= REPORT_WINDOW_S:
            self._report()
            self._window_start_s, self._pinned, self._spilled, self._short = now_s, 0, 0, 0
        if pool.pinned:
            self._pinned += 1
        else:
            self._spilled += 1
            if pressed:
                self._short += 1
                self._reclaimed_until_s = max(self._reclaimed_until_s, now_s + reclaim_s)
        self._metrics.critical_routed.labels("pinned" if pool.pinned else "spilled").inc()

    def reclaimed(self, now_s: float) -> bool:
        """True while the pinned pools must not be lent: critical traffic spilled recently."""
        return now_s < self._reclaimed_until_s

    def status(self) -> dict[str, Any]:
        """For /ready: whether the last report window found the pinned pool too small, and why."""
        return {"undersized": self.hint is not None, "hint": self.hint}

    def _report(self) -> None:
        total = self._pinned + self._spilled
        if total < MIN_REQUESTS:
            return
        self._metrics.pinned_share.set(self._pinned / total)
        short = self._short / total
        self._metrics.pinned_short.set(short)
        if short <= SHORT_SHARE:
            self.hint = None
            return
        self.hint = UNDERSIZED_HINT.format(short=short, total=total, window=REPORT_WINDOW_S)
        log.warning(self.hint)
