"""Gather the inputs of a routing decision, call the pure pipeline, apply its outputs.

Functional core, imperative shell: routing/pipeline.py is the routing of a request (eligibility,
decide, spill, lending, shedding, remote admission, the index-write plan); this module turns an
HTTP body into its input (gateway/serving/request_input.py: model, prompt, hashes; one index lookup,
a snapshot of replica load, the reuse count) and its outcome into I/O (ApiError for a rejection or
a shed, metrics, index writes, the pinned pool's watch). The same plan serves real requests and
/debug/route.

Precise mode (routing.mode: precise): the engines' KV events are the index's truth, so it writes
no index entries of its own; it refreshes the hit prefix on the chosen replica and marks the rest
of the prompt as speculative (routing/speculative.py) until the engine's BlockStored confirms it,
so that a follow-up sent before the event arrives still finds it (routing/pipeline_writes.py).
Approximate mode records a prompt that loads KV from the CPU or remote tier when its load is
estimated to be done (a timer, or its first byte if that comes first), and marks it speculative
until then; any other prompt once the replica accepted it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from gateway.config import GatewayConfig
from gateway.fleet.registry import Registry
from gateway.fleet.replica import Replica
from gateway.http.errors import ApiError, bad_request, no_replica, retry_later
from gateway.index.reuse import ReuseCounter
from gateway.serving import slo
from gateway.serving.pinning import PinnedPoolWatch
from gateway.serving.plan import Plan
from gateway.serving.request_input import (
    PROMPT_PARAM,
    PromptHasher,
    client_salt_of,
    engine_salt,
    load_tokenizers,
    model_of,
    namespace_of,
    prompt_of,
    ttft_slo_of,
)
from gateway.serving.responses import pinned
from gateway.telemetry.metrics import Metrics
from gateway.tenancy.tenants import Tenant
from routing.admission import AdmissionVerdict, family_key
from routing.cost import estimate
from routing.decide import Decision, Policy
from routing.filters import Fallback
from routing.index import Index, record_prompt
from routing.pipeline import (
    FleetView,
    IndexWrites,
    PipelineRequest,
    PipelineSettings,
    PipelineState,
    Routed,
    Shed,
    Write,
    admit,
    index_writes,
    route,
)
from routing.speculative import SPECULATIVE_TTL_S, SpeculativeIndex
from routing.types import BlockHits, TenantClass

if TYPE_CHECKING:  # precise mode only: jinja2 and tokenizers are the [precise] extra
    from gateway.engines.tokenizer import PromptTokenizer

__all__ = [
    "PROMPT_PARAM",
    "Plan",
    "Planner",
    "client_salt_of",
    "engine_salt",
    "load_tokenizers",
    "namespace_of",
    "pipeline_settings",
    "prompt_of",
]

log = logging.getLogger("cachelane.planner")


def pipeline_settings(config: GatewayConfig) -> PipelineSettings:
    """The routing pipeline's settings from the gateway's config."""
    return PipelineSettings(
        policy=config.routing.policy,
        block_size_tokens=config.routing.block_size_tokens,
        fallback=config.critical.fallback,
        critical_budget_ms=config.classes.critical.ttft_budget_ms,
        cost_placement=config.critical.placement == "cost",
        clear_while_loading=config.critical.clear_while_loading,
        batch_max_queue_s=config.overload.batch_max_queue_s,
        precise=config.routing.mode == "precise",
        slo_ms={
            klass: ms
            for klass in TenantClass
            if (ms := getattr(config.classes, klass.value).ttft_slo_ms) is not None
        },
        **_pool_settings(config),
    )


def _pool_settings(config: GatewayConfig) -> dict[str, Any]:
    return {
        "remote_write": {p.name: p.remote_write for p in config.pools},
    }


class Timer(Protocol):
    def cancel(self) -> None: ...


CallLater = Callable[..., Timer]  # (delay_s, callback, *args), as asyncio's loop.call_later


def call_later_on_loop(delay_s: float, callback: Callable[..., None], *args: Any) -> Timer:
    return asyncio.get_running_loop().call_later(delay_s, callback, *args)


class Planner:
    def __init__(
        self,
        config: GatewayConfig,
        registry: Registry,
        index: Index,
        reuse: ReuseCounter,
        metrics: Metrics,
        speculative: SpeculativeIndex | None = None,
        call_later: CallLater = call_later_on_loop,
    ) -> None:
        self._config = config
        self._speculative = speculative
        self._call_later = call_later
        # writes waiting for a request's KV load to be done: id(plan) -> (timer, model, writes)
        self._loading: dict[int, tuple[Timer, str, tuple[Write, ...]]] = {}
        self._recording: set[asyncio.Future[None]] = set()
        self._registry = registry
        self._index = index
        self._reuse = reuse
        self._metrics = metrics
        self._settings = pipeline_settings(config)
        self._state = PipelineState(random.Random(config.routing.seed))
        tokenizers = load_tokenizers(config) if self._settings.precise else {}
        self._hasher = PromptHasher(config, registry, metrics, tokenizers)
        self.pinned = PinnedPoolWatch(metrics)

    @property
    def policy(self) -> Policy:
        return self._settings.policy

    def set_pools(self, config: GatewayConfig, tokenizers: dict[str, PromptTokenizer]) -> None:
        """A reload changed the pools: their remote writes, and (precise mode) their tokenizers
        (load_tokenizers, before anything changed)."""
        self._hasher.tokenizers = tokenizers
        self._settings = replace(self._settings, **_pool_settings(config))

    def model_of(self, body: dict[str, Any]) -> str:
        return model_of(self._registry, self._config, body)

    async def plan(
        self,
        endpoint: str,
        body: dict[str, Any],
        tenant: Tenant,
        *,
        dry_run: bool = False,
        received_s: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Plan:
        """Decide where one request goes, and gather what sending it needs.

        Hashes the prompt (approximate mode: the text of `body`'s messages or prompt; precise
        mode: the engine's token ids), looks the blocks up in the index, and routes it through
        routing/pipeline.py (class filters, decide() with the configured policy, spill, lending,
        shedding), then settles remote-tier admission (counting the prompt's reuse when that
        matters).

        `endpoint`: "chat" or "completions"; `body`: the parsed request body; `tenant`: who sent
        it; `received_s`: when it reached the gateway (perf_counter), for the client's TTFT in the
        estimate header; `headers`: the request's, for its TTFT objective (`x-slo-ttft-ms`).
        With `dry_run` (/debug/route) the decision is made the same way, but
        the request counter, the reuse counts, the critical tenants' bookkeeping and the fallback
        and admission metrics are left as they were. Nothing is written to the index here either way
        (record_sent does that once a replica accepted the request).

        Returns the Plan: the Decision (chosen replica and fallbacks), the hashes and namespace,
        the admission verdict, and the body to forward. An index that fails is routed around
        (no hits), never raised. Raises ApiError: 400 for a missing model or a malformed or
        too-long prompt, 404 for an unknown model, 503 when no healthy or eligible replica is
        left (the pinned pool down or full, per critical.fallback) or when batch traffic is shed
        (with Retry-After); 400 for an `x-slo-ttft-ms` that is not a valid objective.
        """
        started = time.perf_counter()
        model = self.model_of(body)
        requested_slo_ms = ttft_slo_of(headers)
        client_salt = client_salt_of(body)
        cache_salt = engine_salt(tenant, client_salt)
        policy = Policy.LEAST_LOADED if endpoint == "embeddings" else None
        prompt = self._hasher.hashed(endpoint, body, model, tenant, (client_salt, cache_salt))
        self._check_length(model, prompt.prompt_tokens, endpoint)
        if not self._registry.healthy_for(model):
            raise no_replica(model)
        hits = await self._lookup(model, prompt.hashes)
        request = PipelineRequest(
            prompt.hashes, prompt.prompt_tokens, tenant.tenant_class, policy, requested_slo_ms
        )
        routed, decision = self._route(model, request, hits, dry_run=dry_run)
        self._raise_if_shed(routed, tenant, counted=not dry_run)
        # Reuse counts feed remote-tier admission and prewarming only: with Redis they cost a
        # round trip, so a request whose pool has no remote tier skips them unless warming is on.
        chosen = self._registry.replicas[decision.replica]
        family = family_key(prompt.hashes)
        reuse = 0
        if family is not None and (chosen.pool.remote_tier or self._config.prewarm.enabled):
            reuse = await (self._reuse.peek(family) if dry_run else self._reuse.seen(family))
        admission = self._admission(routed, reuse, hits, prompt.prompt_tokens, dry_run=dry_run)
        return Plan(
            model=model,
            tenant=tenant,
            namespace=prompt.namespace,
            cache_salt=cache_salt,
            hashes=prompt.hashes,
            prompt_tokens=prompt.prompt_tokens,
            decision=decision,
            replicas=self._replicas_of(decision),
            fallback=routed.fallback,
            admission=admission,
            reuse=reuse,
            decision_s=time.perf_counter() - started,
            body=body,
            stream=bool(body.get("stream")),
            hits=hits,
            endpoint=endpoint,
            received_s=received_s,
            ttft_objective_ms=None if routed.objective_s is None else 1000 * routed.objective_s,
        )

    def replan(self, plan: Plan) -> Plan:
        """The same request decided again on the load of now (after it waited in flow control),
        with the index hits it looked up. Synchronous: the caller reserves right after."""
        started = time.perf_counter()
        request = PipelineRequest(
            plan.hashes,
            plan.prompt_tokens,
            plan.tenant.tenant_class,
            plan.decision.policy,
            plan.ttft_objective_ms,
        )
        # counted as a dry run: the first plan of this request was counted already
        routed, decision = self._route(plan.model, request, plan.hits, dry_run=True)
        self._raise_if_shed(routed, plan.tenant, counted=True)
        self._state.seq += 1
        admission = self._admission(routed, plan.reuse, plan.hits, plan.prompt_tokens, dry_run=True)
        return replace(
            plan,
            decision=decision,
            replicas=self._replicas_of(decision),
            fallback=routed.fallback,
            admission=admission,
            decision_s=plan.decision_s + time.perf_counter() - started,
        )

    def within_budget(self, plan: Plan, budget_s: float) -> bool:
        """Flow control's test: may this request go now? Yes if one of its candidates, at its
        current load, is estimated to give the first token within `budget_s`, or has an empty
        prefill queue (a request whose own prefill is longer than the budget must still go)."""
        now_s, stale_s = time.monotonic(), self._config.engine_metrics.stale_after_s
        for score in plan.decision.scores:
            replica = plan.replicas[score.replica]  # one that left the fleet is unhealthy
            if not replica.healthy:
                continue
            load = replica.load(now_s, stale_s)
            if load.pending_prefill_tokens == 0:  # only decodes running: the prefill is free
                return True
            priority = plan.engine_priority(replica)
            est = estimate(score.overlap, load, replica.costs, replica.terms, priority)
            if est.ttft_s <= budget_s:
                return True
        return False

    def _replicas_of(self, decision: Decision) -> dict[str, Replica]:
        return {s.replica: self._registry.replicas[s.replica] for s in decision.scores}

    def _route(
        self, model: str, request: PipelineRequest, hits: BlockHits, *, dry_run: bool
    ) -> tuple[Routed, Decision]:
        """The pipeline on the registry's healthy replicas now, and its outcome's I/O: the
        fallback metric, the pinned pool's watch, and ApiError for a rejection (a shed is the
        caller's: _raise_if_shed)."""
        replicas = pinned(self._registry.healthy_for(model))  # previous_response_id's replica
        if not replicas:
            raise no_replica(model)
        now_s, stale_s = time.monotonic(), self._config.engine_metrics.stale_after_s
        pinned_pool = self._registry.has_pinned_pool(model)
        fleet = FleetView(
            [r.candidate(now_s, stale_s) for r in replicas],
            hits,
            now_s,
            pinned_pool_exists=pinned_pool,
            lend=not self.pinned.reclaimed(now_s),
        )
        routed = route(request, fleet, self._settings, self._state, commit=not dry_run)
        if not dry_run and routed.fallback is not None:
            self._metrics.critical_fallbacks.labels(routed.fallback.value).inc()
        if routed.decision is None:
            raise self._rejection(model, routed.fallback)
        klass = request.tenant_class
        if not dry_run and klass is TenantClass.CRITICAL and pinned_pool:
            pool = self._registry.replicas[routed.decision.replica].pool
            self.pinned.served(pool, now_s, pressed=routed.pressed, reclaim_s=routed.reclaim_s)
        return routed, routed.decision

    def _raise_if_shed(self, routed: Routed, tenant: Tenant, *, counted: bool) -> None:
        """A shed request's 503 with Retry-After: the pipeline's estimate of when its best
        queue has drained (Shed.OBJECTIVE), else critical.retry_after_s. `counted`: a real
        request's (not /debug/route's), which moves the shed and attainment counters."""
        if routed.shed is None:
            return
        klass = tenant.tenant_class
        if counted:
            self._metrics.shed.labels(klass.value).inc()
            if routed.objective_s is not None:
                slo.count(self._metrics, tenant, "shed")
        retry_after_s = routed.retry_after_s or self._config.critical.retry_after_s
        why = (
            f"no replica can serve it within its TTFT objective of "
            f"{1000 * routed.objective_s:.0f} ms without delaying more urgent requests"
            if routed.shed is Shed.OBJECTIVE and routed.objective_s is not None
            else "the fleet is overloaded"
        )
        raise retry_later(
            503,
            f"{why}; {klass.value} traffic is shed first; retry later",
            code="overloaded",
            retry_after_s=retry_after_s,
        )

    def _check_length(self, model: str, prompt_tokens: int, endpoint: str) -> None:
        limit = self._registry.max_prompt_tokens(model)
        if limit is not None and prompt_tokens > limit:
            raise bad_request(
                f"the prompt is about {prompt_tokens} tokens; model {model!r} accepts at most "
                f"{limit}",
                code="context_length_exceeded",
                param=PROMPT_PARAM.get(endpoint, "input"),
            )

    def _rejection(self, model: str, fallback: Fallback | None) -> ApiError:
        if fallback is Fallback.REJECT:
            return retry_later(
                503,
                f"the pinned pool for {model!r} is down or at its admission cap",
                code="pinned_pool_unavailable",
                retry_after_s=self._config.critical.retry_after_s,
            )
        return no_replica(model, self._config.critical.retry_after_s)

    async def _lookup(self, model: str, hashes: list[int]) -> BlockHits:
        try:
            return await self._index.lookup(model, hashes)
        except Exception as err:  # the index must never fail a request
            self._metrics.index_errors.labels("lookup").inc()
            log.warning("index lookup failed, routing without cache hits: %r", err)
            return []

    def _admission(
        self, routed: Routed, reuse: int, hits: BlockHits, prompt_tokens: int, *, dry_run: bool
    ) -> AdmissionVerdict | None:
        assert routed.chosen is not None  # _route raised for a rejection
        verdict = admit(routed.chosen, reuse, hits, prompt_tokens, self._settings)
        if verdict is None or dry_run:
            return verdict
        self._metrics.remote_admission.labels("admitted" if verdict.write else "refused").inc()
        kv_bytes = verdict.new_tokens * routed.chosen.costs.kv_bytes_per_token
        if verdict.write:
            self._metrics.remote_bytes_written.inc(kv_bytes)
        else:
            self._metrics.remote_bytes_avoided.inc(kv_bytes)
        return verdict

    async def record_sent(self, plan: Plan, replica: Replica) -> None:
        """Once `replica` accepted the request: the index writes routing/pipeline_writes.py
        plans for then. Those for when its KV load is done wait that long, or for its first
        byte (record_loaded), or its end (settle_loaded); the prompt is marked speculative until
        then, as it is in precise mode until the engine's event."""
        earlier = self._loading.pop(id(plan), None)
        if earlier is not None:  # sent again (a retry): the replica it left never loaded it
            earlier[0].cancel()
        writes = self._writes(plan, replica)
        if writes.speculative is not None and self._speculative is not None:
            where, hashes = writes.speculative
            ttl_s = SPECULATIVE_TTL_S + writes.loaded_after_s if writes.loaded_after_s else None
            self._speculative.speculate(plan.model, list(hashes), where, ttl_s)
        await self._record(plan.model, writes.at_send)
        if not writes.at_loaded:
            return
        if writes.loaded_after_s <= 0.0:
            await self._record(plan.model, writes.at_loaded)
            return
        key, model, at_loaded = id(plan), plan.model, writes.at_loaded
        handle = self._call_later(writes.loaded_after_s, self._record_later, key, model, at_loaded)
        self._loading[key] = (handle, model, at_loaded)

    async def record_loaded(self, plan: Plan, replica: Replica) -> None:
        """At a streamed request's first byte: its load was done (if the estimate had it later,
        its blocks are recorded now), every block of its prompt is in the replica's HBM, and in
        the remote tier if it was to write them there."""
        pending = self._loading.pop(id(plan), None)
        if pending is not None:
            handle, model, at_loaded = pending
            handle.cancel()
            await self._record(model, at_loaded)
        await self._record(plan.model, self._writes(plan, replica).at_first_byte)

    def settle_loaded(self, plan: Plan, *, answered: bool) -> None:
        """A request ended with the writes for its load's end still waiting: an answer's engine
        cached its prompt (recorded now), a failed request's may never have (dropped)."""
        pending = self._loading.pop(id(plan), None)
        if pending is None:
            return
        handle, model, at_loaded = pending
        handle.cancel()
        if answered:
            self._record_later(id(plan), model, at_loaded)

    def _record_later(self, key: int, model: str, writes: tuple[Write, ...]) -> None:
        """The timer's callback: record `writes` in a task of its own."""
        self._loading.pop(key, None)
        task = asyncio.ensure_future(self._record(model, writes))
        self._recording.add(task)  # a reference until it is done: the loop keeps only weak ones
        task.add_done_callback(self._recording.discard)

    def _writes(self, plan: Plan, replica: Replica) -> IndexWrites:
        return index_writes(
            plan.decision.score(replica.name),
            plan.hashes,
            remote_tier=replica.pool.remote_tier or replica.hidden_tier.tier,
            # a tier nobody named takes what its engines write: every prompt, as they showed
            write_remote=(plan.admission is not None and plan.admission.write)
            or (replica.pool.remote_tier is None and replica.hidden_tier.inferred),
            stream=plan.stream,
            settings=self._settings,
        )

    async def _record(self, model: str, writes: tuple[Write, ...]) -> None:
        try:
            for where, hashes in writes:
                await record_prompt(self._index, model, hashes, where)
        except Exception as err:
            self._metrics.index_errors.labels("record").inc()
            log.warning("index record failed: %r", err)
