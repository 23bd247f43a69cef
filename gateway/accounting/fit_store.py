"""Share the learned cost fits through Redis, so a new gateway starts warm.

Every FIT_SHARE_INTERVAL_S each gateway writes its fits (gateway/accounting/calibration.py
`states()`) into one Redis hash; at start a gateway adopts any shared fit with more observations
than its own (`CostLearner.resume`; a fit seeded from different constants is ignored). A Redis that
is away costs nothing but the sharing: it is logged, and routing goes on with the local fits.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from gateway.accounting.calibration import CostLearner

log = logging.getLogger("cachelane.fit_store")

FITS_KEY = "cachelane:cost-fits"  # one hash: field = replica or "pool:NAME", value = JSON state
FIT_SHARE_INTERVAL_S = 5.0  # ~50 requests/s per gateway: a few hundred observations per write
FITS_TTL_S = 86_400  # a fleet gone for a day leaves nothing behind


class FitStore:
    def __init__(self, redis: Any, learner: CostLearner) -> None:
        self._redis = redis
        self._learner = learner

    async def load(self) -> int:
        """Adopt the shared fits that know more than ours; returns how many."""
        try:
            raw = await self._redis.hgetall(FITS_KEY)
        except Exception as err:
            log.warning("cannot read shared cost fits, starting from the config's: %r", err)
            return 0
        states: dict[str, dict[str, object]] = {}
        for field, value in raw.items():
            try:
                state = json.loads(value)
            except ValueError:
                continue
            if isinstance(state, dict):
                states[field.decode() if isinstance(field, bytes) else str(field)] = state
        adopted = self._learner.resume(states)
        if adopted:
            log.info("adopted %d shared cost fits from Redis", adopted)
        return adopted

    async def save(self) -> None:
        mapping = {name: json.dumps(state) for name, state in self._learner.states().items()}
        await self._redis.hset(FITS_KEY, mapping=mapping)
        await self._redis.expire(FITS_KEY, FITS_TTL_S)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(FIT_SHARE_INTERVAL_S)
            try:
                await self.save()
            except Exception as err:
                log.warning("cannot share cost fits: %r", err)
