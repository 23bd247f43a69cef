"""Gather the inputs of a routing decision, call routing.decide(), apply its outputs.

Functional core, imperative shell: this module does the I/O around the pure decision (one index
lookup, a snapshot of replica load) and the bookkeeping after it (speculative index entries),
and nothing else. The same plan serves real requests and /debug/route.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from gateway.config import GatewayConfig
from gateway.errors import ApiError, bad_request, no_replica
from gateway.metrics import Metrics
from gateway.registry import Registry, Replica
from routing.decide import Decision, Policy, RouteRequest, decide
from routing.hashing import block_hashes
from routing.index import Index
from routing.prompt import PromptError, approx_tokens, chat_text, completion_text
from routing.types import BlockHits, Location, Tier

log = logging.getLogger("cachelane.planner")


@dataclass(frozen=True)
class Plan:
    model: str
    namespace: str
    hashes: list[int]
    prompt_tokens: int
    decision: Decision
    replicas: dict[str, Replica]  # candidates by name, for the proxy's fallbacks
    decision_s: float


def prompt_of(endpoint: str, body: dict[str, Any]) -> str:
    try:
        if endpoint == "chat":
            return chat_text(body.get("messages"))
        return completion_text(body.get("prompt"))
    except PromptError as err:
        raise bad_request(str(err), param="messages" if endpoint == "chat" else "prompt") from None


class Planner:
    def __init__(
        self, config: GatewayConfig, registry: Registry, index: Index, metrics: Metrics
    ) -> None:
        self._config = config
        self._registry = registry
        self._index = index
        self._metrics = metrics
        self._policy: Policy = config.routing.policy
        self._block_size = config.routing.block_size_tokens
        self._rng = random.Random(config.routing.seed)
        self._seq = 0

    @property
    def policy(self) -> Policy:
        return self._policy

    def model_of(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("'model' is required and must be a string", param="model")
        if model not in self._registry.known_models():
            raise ApiError(
                404,
                f"the model {model!r} does not exist; GET /v1/models lists the served models",
                code="model_not_found",
                param="model",
            )
        return model

    async def plan(self, endpoint: str, body: dict[str, Any]) -> Plan:
        started = time.perf_counter()
        model = self.model_of(body)
        text = prompt_of(endpoint, body)
        prompt_tokens = approx_tokens(text)
        pool = self._registry.pool_of_model(model)
        if pool is not None and pool.max_prompt_tokens and prompt_tokens > pool.max_prompt_tokens:
            raise bad_request(
                f"the prompt is about {prompt_tokens} tokens; model {model!r} accepts at most "
                f"{pool.max_prompt_tokens}",
                code="context_length_exceeded",
                param="messages" if endpoint == "chat" else "prompt",
            )
        namespace = model
        hashes = block_hashes(text, block_size_tokens=self._block_size, namespace=namespace)
        replicas = self._registry.healthy_for(model)
        if not replicas:
            raise no_replica(model)
        hits = await self._lookup(model, hashes)
        now_s, stale_s = time.monotonic(), self._config.engine_metrics.stale_after_s
        request = RouteRequest(hashes, prompt_tokens, self._block_size)
        decision = decide(
            request,
            [r.candidate(now_s, stale_s) for r in replicas],
            hits,
            self._policy,
            seq=self._seq,
            rng=self._rng,
        )
        self._seq += 1
        return Plan(
            model=model,
            namespace=namespace,
            hashes=hashes,
            prompt_tokens=prompt_tokens,
            decision=decision,
            replicas={r.name: r for r in replicas},
            decision_s=time.perf_counter() - started,
        )

    async def _lookup(self, model: str, hashes: list[int]) -> BlockHits:
        try:
            return await self._index.lookup(model, hashes)
        except Exception as err:  # the index must never fail a request
            self._metrics.index_errors.labels("lookup").inc()
            log.warning("index lookup failed, routing without cache hits: %r", err)
            return []

    async def record_sent(self, plan: Plan, replica: Replica) -> None:
        """Approximate mode: the replica will hold the prompt's blocks in HBM after this request."""
        try:
            await self._index.record(plan.model, plan.hashes, Location(replica.name, Tier.HBM))
            if replica.pool.remote_tier:
                remote = Location(replica.pool.remote_tier, Tier.REMOTE)
                await self._index.record(plan.model, plan.hashes, remote)
        except Exception as err:
            self._metrics.index_errors.labels("record").inc()
            log.warning("index record failed: %r", err)
