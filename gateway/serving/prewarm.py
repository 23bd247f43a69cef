"""Prewarming: put a hot prefix's KV on a replica before a request needs it. Never on the request
path: triggers only enqueue (non-blocking, bounded queue); one worker sends the warms, at most
`max_per_s`, within a budget of prompt tokens per minute.

Triggers (checked after a request has been routed):
  critical   a critical tenant's prefix family is hot (seen `hot_after` times in the reuse window):
             warm it on every pinned replica that does not hold it in HBM, so the next critical
             request finds it wherever admission sends it.
  saturated  a hot family's HBM holders lost on queueing (decision reason "queue"): warm it on the
             next replica in the ranking, which loads it from the remote tier if its engine finds
             it there and that is cheaper (the simulator's /prefetch and vLLM+LMCache both do).

The warmed prefix is the request's system/developer messages (chat) or the whole prompt
(completions). A warm is a prefill-only request (max_tokens 1) that any OpenAI-compatible engine
serves, or the simulator's POST /prefetch (`method: prefetch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.config import PrewarmConfig
from gateway.fleet.registry import Registry
from gateway.fleet.replica import Replica
from gateway.serving.plan import Plan
from gateway.serving.planner import prompt_of
from gateway.serving.proxy import NAMESPACE_HEADER, REMOTE_WRITE_HEADER
from gateway.telemetry.metrics import Metrics
from routing.decide import Reason
from routing.hashing import block_hashes
from routing.index import Index, record_prompt
from routing.prompt import approx_tokens
from routing.types import Location, TenantClass, Tier

log = logging.getLogger("cachelane.prewarm")

_PREFIX_ROLES = ("system", "developer")


@dataclass(frozen=True, slots=True)
class WarmJob:
    trigger: str
    replica: Replica
    model: str
    namespace: str
    endpoint: str  # "chat" or "completions"
    body: dict[str, Any]  # the prefix to warm, as a request body
    hashes: list[int]
    tokens: int


def warm_prefix(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """The hot part of a request: its leading system/developer messages, else the whole prompt."""
    if endpoint == "chat":
        messages = body.get("messages") or []
        lead = 0
        while lead < len(messages) and messages[lead].get("role") in _PREFIX_ROLES:
            lead += 1
        kept = messages[:lead] if lead else messages
        return {"model": body["model"], "messages": kept}
    return {"model": body["model"], "prompt": body.get("prompt")}


class Prewarmer:
    def __init__(
        self,
        config: PrewarmConfig,
        client: httpx.AsyncClient,
        registry: Registry,
        index: Index,
        metrics: Metrics,
        *,
        block_size_tokens: int,
    ) -> None:
        self._config = config
        self._client = client
        self._registry = registry
        self._index = index
        self._metrics = metrics
        self._block_size = block_size_tokens
        self._queue: asyncio.Queue[WarmJob] = asyncio.Queue(maxsize=config.queue_size)
        self._pending: set[tuple[str, int]] = set()  # (replica, last hash) queued or in flight
        self._budget_window_start_s = time.monotonic()
        self._budget_used_tokens = 0

    def consider(self, plan: Plan) -> None:
        """Called after routing `plan`: enqueue the warms its prefix family's heat calls for."""
        if not self._config.enabled or plan.reuse + 1 < self._config.hot_after:
            return
        decision = plan.decision
        if plan.tenant.tenant_class is TenantClass.CRITICAL:
            targets = [
                r
                for r in self._registry.replicas.values()
                if r.healthy
                and r.pool.pinned
                and plan.model in r.models
                and r.name != decision.replica
            ]
            self._offer_all("critical", plan, targets)
        elif decision.reason is Reason.QUEUE:
            nxt = next((n for n in decision.ranking[1:] if plan.replicas[n].healthy), None)
            if nxt is not None:
                self._offer_all("saturated", plan, [plan.replicas[nxt]])

    def _offer_all(self, trigger: str, plan: Plan, targets: list[Replica]) -> None:
        if not targets:
            return
        endpoint = "chat" if "messages" in plan.body else "completions"
        body = warm_prefix(endpoint, plan.body)
        text = prompt_of(endpoint, body)
        hashes = block_hashes(text, block_size_tokens=self._block_size, namespace=plan.namespace)
        if not hashes:
            return
        for replica in targets:
            held = (
                plan.decision.score(replica.name).overlap.hbm_tokens
                if (replica.name in plan.replicas)
                else 0
            )
            if held >= len(hashes) * self._block_size:
                continue
            self._offer(
                WarmJob(
                    trigger,
                    replica,
                    plan.model,
                    plan.namespace,
                    endpoint,
                    # the request's salt, or the warm fills a namespace no tenant reads
                    {**body, "cache_salt": plan.cache_salt} if replica.pool.cache_salt else body,
                    hashes,
                    approx_tokens(text),
                )
            )

    def _offer(self, job: WarmJob) -> None:
        key = (job.replica.name, job.hashes[-1])
        if key in self._pending:
            return
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            self._metrics.prewarms.labels(job.trigger, "dropped_queue_full").inc()
            return
        self._pending.add(key)
        self._metrics.prewarms.labels(job.trigger, "queued").inc()

    def _within_budget(self, tokens: int) -> bool:
        now = time.monotonic()
        if now - self._budget_window_start_s >= 60.0:
            self._budget_window_start_s, self._budget_used_tokens = now, 0
        if self._budget_used_tokens + tokens > self._config.budget_tokens_per_min:
            return False
        self._budget_used_tokens += tokens
        return True

    async def run(self) -> None:
        interval_s = 1.0 / self._config.max_per_s
        while True:
            job = await self._queue.get()
            try:
                if not job.replica.healthy:
                    self._metrics.prewarms.labels(job.trigger, "skipped_unhealthy").inc()
                elif not self._within_budget(job.tokens):
                    self._metrics.prewarms.labels(job.trigger, "skipped_budget").inc()
                else:
                    await self._warm(job)
                    await asyncio.sleep(interval_s)
            finally:
                self._pending.discard((job.replica.name, job.hashes[-1]))

    async def _warm(self, job: WarmJob) -> None:
        headers = {NAMESPACE_HEADER: job.namespace, REMOTE_WRITE_HEADER: "0"}
        if self._config.method == "prefetch":
            url, body = f"{job.replica.url}/prefetch", job.body
        else:
            path = "/v1/chat/completions" if job.endpoint == "chat" else "/v1/completions"
            url, body = job.replica.url + path, {**job.body, "max_tokens": 1, "stream": False}
        started = time.perf_counter()
        try:
            resp = await self._client.post(
                url,
                content=json.dumps(body).encode(),
                headers={"content-type": "application/json", **headers, **job.replica.auth_headers},
                timeout=self._config.timeout_s,
            )
            resp.raise_for_status()
        except httpx.HTTPError as err:
            self._metrics.prewarms.labels(job.trigger, "failed").inc()
            log.warning("prewarm of %d tokens on %s failed: %r", job.tokens, job.replica.name, err)
            return
        with contextlib.suppress(Exception):
            hbm = Location(job.replica.name, Tier.HBM)
            await record_prompt(self._index, job.model, job.hashes, hbm)
        self._metrics.prewarms.labels(job.trigger, "warmed").inc()
        log.info(
            "prewarmed %d tokens on %s (%s) in %.0f ms",
            job.tokens,
            job.replica.name,
            job.trigger,
            (time.perf_counter() - started) * 1000,
        )

    @property
    def idle(self) -> bool:
        return not self._pending and self._queue.empty()
