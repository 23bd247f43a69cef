"""Share the cost accounting: between gateways through Redis (`cachelane report --redis` sees a
fleet), and between the worker processes of `cachelane serve --workers N` (WorkerCosts).

Every COST_SHARE_INTERVAL_S a gateway with a Redis index writes its /debug/costs windows (the
1 min, 15 min and 1 h snapshots, gateway/accounting/ledger.py) into one Redis hash, under a field
naming the gateway; a reader takes every field written within STALE_AFTER_S and merges them as it
merges several URLs (gateway/accounting/findings.py `merge`). One hash, not a key per gateway, so it
works on a Redis Cluster without scanning its nodes. A Redis that is away costs nothing but the
sharing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.accounting.ledger import CostAccounting
from gateway.fleet.siblings import pid_alive
from routing.accounting import WINDOWS_S

log = logging.getLogger("cachelane.cost_store")

COSTS_KEY = "cachelane:costs"  # one hash: field = gateway id, value = JSON {"at_unix", "windows"}
COST_SHARE_INTERVAL_S = 10.0  # the accounting's bucket (routing.accounting.BUCKET_S): finer
# sharing would show nothing new
STALE_AFTER_S = 3 * COST_SHARE_INTERVAL_S  # a gateway that missed 3 shares is gone: left out
FORGET_AFTER_S = max(WINDOWS_S)  # fields older than the longest window are deleted on write
COSTS_TTL_S = 86_400  # a fleet gone for a day leaves nothing behind


def gateway_id() -> str:
    """Unique per process: host, pid and a random suffix (two gateways may share a host)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class CostStore:
    def __init__(self, redis: Any, costs: CostAccounting, name: str | None = None) -> None:
        self._redis = redis
        self._costs = costs
        self.name = name or gateway_id()

    async def save(self) -> None:
        now = time.time()
        value = {"at_unix": now, "windows": [self._costs.snapshot(w) for w in WINDOWS_S]}
        await self._redis.hset(COSTS_KEY, self.name, json.dumps(value))
        await self._redis.expire(COSTS_KEY, COSTS_TTL_S)
        shared = published_at(await self._redis.hgetall(COSTS_KEY))
        stale = [field for field, at in shared.items() if now - at > FORGET_AFTER_S]
        if stale:
            await self._redis.hdel(COSTS_KEY, *stale)

    async def run(self) -> None:
        while True:
            try:
                await self.save()
            except Exception as err:
                log.warning("cannot share the cost accounting: %r", err)
            await asyncio.sleep(COST_SHARE_INTERVAL_S)


def _decoded(raw: Mapping[Any, Any]) -> dict[str, Any]:
    out = {}
    for field, value in raw.items():
        name = field.decode() if isinstance(field, bytes) else str(field)
        try:
            out[name] = json.loads(value)
        except (ValueError, TypeError):
            continue
    return out


def published_at(raw: Mapping[Any, Any]) -> dict[str, float]:
    """When each gateway last wrote its field (malformed fields: 0, i.e. stale)."""
    out = {}
    for name, value in _decoded(raw).items():
        at = value.get("at_unix") if isinstance(value, dict) else None
        out[name] = float(at) if isinstance(at, int | float) else 0.0
    return out


def shared_windows(
    raw: Mapping[Any, Any], window_s: float, now_unix: float
) -> tuple[list[dict[str, Any]], float]:
    """The fresh gateways' snapshots of the shortest shared window that covers `window_s`:
    (windows, that window's length)."""
    window = min((w for w in WINDOWS_S if w >= window_s), default=max(WINDOWS_S))
    out = []
    for value in _decoded(raw).values():
        if not isinstance(value, dict) or now_unix - float(value.get("at_unix", 0)) > STALE_AFTER_S:
            continue
        for snap in value.get("windows", []):
            if isinstance(snap, dict) and snap.get("window_s") == window:
                out.append(snap)
    return out, window


WORKER_SHARE_INTERVAL_S = 1.0
# --workers N: a worker's windows reach its siblings' /debug/costs within a second (a file write
# of a few kB per second per worker)
WORKER_STALE_AFTER_S = 5 * WORKER_SHARE_INTERVAL_S  # a worker that stopped writing is gone
LEADER_CHECK_S = 0.5  # how long a worker trusts its last look at which workers are alive


class WorkerCosts:
    """`cachelane serve --workers N`: each worker's accounting in a file of the workers' directory
    (`costs-<pid>.json`, written whole then renamed), so the worker that answers /debug/costs
    merges its siblings' with its own. `leads()`: this worker has the lowest live pid; where every
    worker's index sees every worker's evictions (the memory index fed by its siblings, or the
    engines' events in precise mode), only the leader counts them."""

    def __init__(self, directory: Path, costs: CostAccounting, pid: int | None = None) -> None:
        self.directory = directory
        self._costs = costs
        self.pid = os.getpid() if pid is None else pid
        self._leader = True
        self._checked_at = float("-inf")

    def leads(self) -> bool:
        """Whether this worker has the lowest live pid (looked up at most every LEADER_CHECK_S,
        so a worker started after this one, or one gone, is taken into account promptly)."""
        now = time.monotonic()
        if now - self._checked_at >= LEADER_CHECK_S:
            self._leader = self.pid == min(self._live_pids())
            self._checked_at = now
        return self._leader

    def _live_pids(self) -> set[int]:
        pids = {self.pid}
        for path in self.directory.glob("worker-*.sock"):
            with contextlib.suppress(ValueError):
                pid = int(path.stem.removeprefix("worker-"))
                if pid_alive(pid):
                    pids.add(pid)
        return pids

    def save(self) -> None:
        value = {"at_unix": time.time(), "windows": [self._costs.snapshot(w) for w in WINDOWS_S]}
        tmp = self.directory / f".costs-{self.pid}.json.tmp"
        tmp.write_text(json.dumps(value))
        tmp.replace(self.directory / f"costs-{self.pid}.json")

    async def run(self) -> None:
        while True:
            try:
                self.save()
            except OSError as err:
                log.warning("cannot share the cost accounting with the other workers: %r", err)
            await asyncio.sleep(WORKER_SHARE_INTERVAL_S)

    def siblings_windows(self, window_s: float) -> list[dict[str, Any]]:
        """The other live workers' snapshots of `window_s` (one of WINDOWS_S)."""
        now, out = time.time(), []
        for path in self.directory.glob("costs-*.json"):
            if path.stem == f"costs-{self.pid}":
                continue
            try:
                value = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if now - float(value.get("at_unix", 0)) > WORKER_STALE_AFTER_S:
                continue
            out += [w for w in value.get("windows", []) if w.get("window_s") == window_s]
        return out
