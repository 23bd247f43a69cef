"""Opt-in traffic capture for planning (`capture.path`): one JSON line per answered request, with
the prompt's structure and its outcome, never its text (the format: routing/whatif/capture.py).

The proxy calls `answered()` on the event loop when an answer ends; it builds the record (the
block hashes as hex, token counts, the decision, the outcome) and hands it to a bounded queue. One
writer thread serializes and writes the lines, so file IO never runs on the event loop. The file
is bounded by `capture.max_bytes` and `capture.max_records`: when the next line would pass
either, the capture stops (the file keeps the first part of the traffic whole; a planner replays
a contiguous window) and every later record counts as dropped, as does a record that finds the
queue full. A file already at `path` when the gateway starts is moved to `path`.1.

Every FIT_EVERY_RECORDS records, and when the gateway stops, the cost terms in use per replica
(the learned fit, routing/learn.py) are written too, so the planner prices the replay with them.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from gateway.config import CaptureConfig, GatewayConfig
from gateway.fleet.registry import Registry
from gateway.fleet.replica import Reservation
from gateway.serving.planner import Plan
from gateway.telemetry.metrics import Metrics
from routing.admission import DEFAULT_WINDOW_S
from routing.cost import HBM_CAPACITY_TOKENS, CostTerms
from routing.types import TenantClass
from routing.whatif.capture import VERSION, hex_hashes, hit_tiers, terms_record

log = logging.getLogger("cachelane.capture")

QUEUE_RECORDS = 10_000
# Records waiting for the writer thread: at ~7 KB per 6k-token prompt ~70 MB at worst, and some
# seconds of traffic at thousands of requests/s if the disk stalls; past it records are dropped.

FIT_EVERY_RECORDS = 500  # a fit line every 500 requests: a capture cut short still has one

_STOP = object()


def header(config: GatewayConfig, registry: Registry) -> dict[str, Any]:
    """The set-up the captured traffic is served on (HBM capacities as the router uses them:
    the config's, else what the engines report, else the default)."""
    pools = []
    for p in config.pools:
        replicas = [r for r in registry.replicas.values() if r.pool.name == p.name]
        hbm = replicas[0].hbm_capacity_tokens() if replicas else p.hbm_capacity_tokens
        pools.append(
            {
                "name": p.name,
                "replicas": [r.name for r in replicas],
                "hbm_capacity_tokens": hbm or HBM_CAPACITY_TOKENS,
                "cpu_capacity_tokens": p.cpu_capacity_tokens,
                "remote_tier": p.remote_tier,
                "remote_write": p.remote_write,
                "pinned": p.pinned,
                "hbm_only": p.hbm_only,
                "admission": p.admission.model_dump(),
                "lend_below": p.lend_below,
                "engine_priority": p.engine_priority,
                "costs": p.costs.model_dump(),
            }
        )
    return {
        "type": "header",
        "version": VERSION,
        "started_unix_s": round(time.time(), 3),
        "block_size_tokens": config.routing.block_size_tokens,
        "mode": config.routing.mode,
        "policy": config.routing.policy.value,
        "index_ttl_s": config.index.ttl_s,
        "reuse_window_s": DEFAULT_WINDOW_S,
        "pools": pools,
        "remote_tiers": {t.name: t.capacity_tokens for t in config.remote_tiers},
        "critical_fallback": config.critical.fallback.value,
        "critical_budget_ms": config.classes.critical.ttft_budget_ms,
        "critical_placement": config.critical.placement,
        "clear_while_loading": config.critical.clear_while_loading,
        "batch_max_queue_s": config.overload.batch_max_queue_s,
        "class_slo_ms": {
            k.value: ms
            for k in TenantClass
            if (ms := getattr(config.classes, k.value).ttft_slo_ms) is not None
        },
    }


class Capture:
    def __init__(
        self,
        config: CaptureConfig,
        head: Callable[[], dict[str, Any]],
        metrics: Metrics,
        fits: Callable[[], dict[str, tuple[str, CostTerms]]],
    ) -> None:
        """`head()`: the header record, built when the first request is captured (the engines'
        reported capacities are known by then); `fits()`: replica -> (pool, terms in use)."""
        assert config.path is not None
        self._path = Path(config.path)
        self._max_bytes = config.max_bytes
        self._max_records = config.max_records
        self._metrics = metrics
        self._fits = fits
        self._queue: queue.Queue[object] = queue.Queue(QUEUE_RECORDS)
        self._t0 = time.perf_counter()
        self._records = 0  # request records handed to the writer
        self._full = False
        self._thread = threading.Thread(target=self._write_loop, name="capture", daemon=True)
        self._head = head

    def start(self) -> None:
        if self._path.exists():
            os.replace(self._path, self._path.with_name(self._path.name + ".1"))
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = self._path.open("w", encoding="utf-8")
        self._bytes = 0
        self._written = 0
        self._thread.start()
        log.info("capturing traffic to %s", self._path)

    def answered(
        self,
        plan: Plan,
        reservation: Reservation,
        *,
        status: int,
        ttft_s: float | None,
        cached_tokens: int | None,
        prompt_tokens: int | None,
    ) -> None:
        """An answer ended (its last byte, or an error the replica sent)."""
        if plan.endpoint == "embeddings" or self._full:
            if self._full:
                self._metrics.capture_records.labels("dropped").inc()
            return
        replica = reservation.replica
        score = plan.decision.score(replica.name)
        o, e = score.overlap, score.estimate
        remote = o.remote_tokens if e.remote_fetch else 0
        prompt = prompt_tokens if prompt_tokens is not None else plan.prompt_tokens
        hit = hit_tiers(prompt, o.hbm_tokens, o.cpu_tokens, remote, cached_tokens)
        now = time.perf_counter()
        limit = plan.body.get("max_tokens", plan.body.get("max_completion_tokens"))
        if self._records == 0:
            self._put(self._head())
        record = {
            "type": "request",
            "t_s": round(reservation.started_s - self._t0, 6),
            "tenant": plan.tenant.name,
            "class": plan.tenant.tenant_class.value,
            "model": plan.model,
            "endpoint": plan.endpoint,
            "stream": plan.stream,
            "ttft_slo_ms": plan.ttft_objective_ms,
            "pool": replica.pool.name,
            "replica": replica.name,
            "reason": plan.decision.reason.value,
            "prompt_tokens": plan.prompt_tokens,
            "hashes": hex_hashes(plan.hashes),
            "max_tokens": limit if isinstance(limit, int) else None,
            "est_ttft_s": round(e.ttft_s, 6),
            "expected": {"hbm": o.hbm_tokens, "cpu": o.cpu_tokens, "remote": o.remote_tokens},
            "remote_fetch": e.remote_fetch,
            "remote_write": None if plan.admission is None else plan.admission.write,
            "status": status,
            "ttft_s": None if ttft_s is None else round(ttft_s, 6),
            "e2e_s": round(now - reservation.started_s, 6),
            "engine_prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "hit": hit.as_dict(),
        }
        self._records += 1
        self._put(record)
        if self._records % FIT_EVERY_RECORDS == 0:
            self._put(self._fit_record())

    def _fit_record(self) -> dict[str, Any]:
        return {
            "type": "fit",
            "t_s": round(time.perf_counter() - self._t0, 3),
            "replicas": {
                name: terms_record(terms, pool) for name, (pool, terms) in self._fits().items()
            },
        }

    def _put(self, record: dict[str, Any]) -> None:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._metrics.capture_records.labels("dropped").inc()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            line = json.dumps(item, separators=(",", ":")) + "\n"
            is_request = isinstance(item, dict) and item.get("type") == "request"
            if is_request and (self._full or not self._fits_in(line)):
                self._metrics.capture_records.labels("dropped").inc()
                continue
            if self._bytes + len(line.encode()) > self._max_bytes:
                continue  # a fit line that does not fit: the previous one stands
            try:
                self._file.write(line)
            except OSError as err:
                log.warning("traffic capture stopped, cannot write %s: %r", self._path, err)
                self._full = True
                continue
            self._bytes += len(line.encode())
            if is_request:
                self._written += 1
                self._metrics.capture_records.labels("written").inc()
            if self._queue.empty():  # nothing waiting: a planner may read the file now
                self._file.flush()
        self._file.close()

    def _fits_in(self, line: str) -> bool:
        """Whether a request line fits; the capture stops at the first that does not."""
        size = len(line.encode())
        if self._bytes + size > self._max_bytes or self._written >= self._max_records:
            self._full = True
            log.warning(
                "traffic capture %s is full (%d records, %d bytes): it stops here",
                self._path,
                self._written,
                self._bytes,
            )
            return False
        return True

    def close(self) -> None:
        """Write the last fit, flush and close; blocks until the writer is done (call it from a
        worker thread in async code)."""
        if not self._thread.is_alive():
            return
        self._queue.put(self._fit_record())
        self._queue.put(_STOP)
        self._thread.join()
