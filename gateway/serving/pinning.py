"""How well the pinned pool serves the critical class: live lending and an undersizing alarm.

Every routed critical request reports where it went (`served`). A critical request that had to
leave the pinned pool means the pool has no headroom: lending it to other classes stops at once
and resumes LEND_COOLDOWN_S after the last spill (`reclaimed`), so lending follows the critical
load as it moves, not a static fraction. Over each REPORT_WINDOW_S the share of critical requests
the pinned pools took is a metric, and when it falls below UNDERSIZED_SHARE the operator is told,
once per window, that the pool is too small for the critical demand.
"""

from __future__ import annotations

import logging

from gateway.config import PoolConfig
from gateway.telemetry.metrics import Metrics
from routing.pipeline import LEND_COOLDOWN_S  # one rule for the gateway and the what-if replay

log = logging.getLogger("cachelane.pinning")

REPORT_WINDOW_S = 60.0
UNDERSIZED_SHARE = 0.8  # below 80% of critical requests on pinned replicas: the pool is too small
MIN_REQUESTS = 20  # fewer critical requests in a window say nothing about the pool's size


class PinnedPoolWatch:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._last_spill_s = -LEND_COOLDOWN_S
        self._window_start_s: float | None = None
        self._pinned = 0
        self._spilled = 0

    def served(self, pool: PoolConfig, now_s: float, *, pressed: bool = True) -> None:
        """A critical request was routed to a replica of `pool`. `pressed`: for a request off the
        pinned pool, whether the pool lacked headroom (with critical.placement: cost a request
        may leave it for its context's sake; that does not reclaim lent replicas)."""
        if self._window_start_s is None:
            self._window_start_s = now_s
        if now_s - self._window_start_s >= REPORT_WINDOW_S:
            self._report()
            self._window_start_s, self._pinned, self._spilled = now_s, 0, 0
        if pool.pinned:
            self._pinned += 1
        else:
            self._spilled += 1
            if pressed:
                self._last_spill_s = now_s
        self._metrics.critical_routed.labels("pinned" if pool.pinned else "spilled").inc()

    def reclaimed(self, now_s: float) -> bool:
        """True while the pinned pools must not be lent: critical traffic spilled recently."""
        return now_s - self._last_spill_s < LEND_COOLDOWN_S

    def _report(self) -> None:
        total = self._pinned + self._spilled
        if total < MIN_REQUESTS:
            return
        share = self._pinned / total
        self._metrics.pinned_share.set(share)
        if share < UNDERSIZED_SHARE:
            log.warning(
                "the pinned pool took only %.0f%% of %d critical requests in the last %.0f s; "
                "the rest spilled to the shared pools: add pinned replicas or raise its "
                "admission cap",
                100 * share,
                total,
                REPORT_WINDOW_S,
            )
