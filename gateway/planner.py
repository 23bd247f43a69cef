"""Gather the inputs of a routing decision, call the pure core, apply its outputs.

Functional core, imperative shell: this module does the I/O around the decision (one index
lookup, a snapshot of replica load, the reuse count) and the bookkeeping after it (speculative
index entries), and nothing else. The same plan serves real requests and /debug/route.

Precise mode (routing.mode: precise) hashes the engine's token ids (the pool's tokenizer and chat
template, gateway/engines/tokenizer.py) in the namespace gateway/engines/events.py explains. The
engines' KV events are the truth, so it writes no index entries of its own: it refreshes the TTL
of the hit prefix on the chosen replica (blocks the events said are there, which this request now
touches) and marks the rest of the prompt as speculative (routing/speculative.py) until the
engine's BlockStored confirms it, so that a follow-up sent before the event arrives still finds
it.
"""

from __future__ import annotations

import logging
import random
import string
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import xxhash

from gateway.config import ConfigError, GatewayConfig
from gateway.engines.events import precise_namespace
from gateway.errors import ApiError, bad_request, no_replica
from gateway.metrics import Metrics
from gateway.pinning import PinnedPoolWatch
from gateway.registry import Registry, Replica
from gateway.reuse import ReuseCounter
from gateway.tenants import Tenant
from routing.admission import AdmissionVerdict, family_key, should_write
from routing.cost import estimate
from routing.decide import Candidate, Decision, Policy, RouteRequest, decide
from routing.filters import Eligibility, Fallback, admitted, eligible, lendable, should_shed
from routing.hashing import PrefixHasher, token_block_hashes
from routing.index import Index, record_prompt
from routing.prompt import (
    PromptError,
    approx_tokens,
    chat_text,
    completion_text,
    embedding_text,
    responses_messages,
)
from routing.speculative import SpeculativeIndex
from routing.types import ENGINE_PRIORITY, BlockHits, Location, TenantClass, Tier

if TYPE_CHECKING:  # precise mode only: jinja2 and tokenizers are the [precise] extra
    from gateway.engines.tokenizer import PromptTokenizer

log = logging.getLogger("cachelane.planner")


@dataclass(frozen=True)
class Plan:
    model: str
    tenant: Tenant
    namespace: str
    cache_salt: str
    hashes: list[int]
    prompt_tokens: int
    decision: Decision
    replicas: dict[str, Replica]  # candidates by name, for the proxy's fallbacks
    fallback: Fallback | None
    admission: AdmissionVerdict | None  # None: the chosen pool has no remote tier
    reuse: int  # earlier requests of this family in the reuse window (0: not counted, see plan())
    decision_s: float
    body: dict[str, Any]
    stream: bool
    hits: BlockHits = field(repr=False, default_factory=list)  # the index lookup it was made on
    endpoint: str = "chat"  # chat, completions, responses, embeddings
    received_s: float | None = None  # perf_counter when the request reached the gateway

    def in_gateway_s(self, sent_s: float) -> float:
        """How long the request was in the gateway before it was sent at `sent_s` (reading the
        body, deciding, flow control, a failed attempt): part of the client's TTFT, measured."""
        return max(0.0, sent_s - self.received_s) if self.received_s is not None else 0.0

    def engine_priority(self, replica: Replica) -> int | None:
        """The `priority` the request carries to `replica`: its class's, where the replica's pool
        schedules by priority (pools[].engine_priority); None elsewhere."""
        if not replica.pool.engine_priority:
            return None
        return ENGINE_PRIORITY[self.tenant.tenant_class]


PROMPT_PARAM = {"chat": "messages", "completions": "prompt", "responses": "input"}


def prompt_of(endpoint: str, body: dict[str, Any]) -> str:
    try:
        if endpoint == "chat":
            return chat_text(body.get("messages"))
        if endpoint == "responses":
            return chat_text(responses_messages(body.get("input"), body.get("instructions")))
        if endpoint == "embeddings":
            return embedding_text(body.get("input"))
        return completion_text(body.get("prompt"))
    except PromptError as err:
        raise bad_request(str(err), param=PROMPT_PARAM.get(endpoint, "input")) from None


def client_salt_of(body: dict[str, Any]) -> str | None:
    """vLLM's `cache_salt` as the client sent it (a non-empty string, as vLLM requires)."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise bad_request("'cache_salt' must be a non-empty string if provided", param="cache_salt")
    return salt


_HEADER_SAFE = "".join(c for c in string.punctuation if c != "%")


def namespace_of(model: str, tenant: Tenant, client_salt: str | None = None) -> str:
    """Hash namespace: prefixes are shared within one model and one tenant cache scope, and
    within one client `cache_salt` (the engine shares no prefix across salts).

    It travels to the replicas in a header (proxy.NAMESPACE_HEADER), whose values are ASCII: a
    tenant or share-group name is a label, not a header value, so everything but printable ASCII
    (and `%` itself, to stay one-to-one) is percent-encoded as UTF-8 (RFC 3986)."""
    namespace = quote(f"{model}|{tenant.cache_scope}", safe=_HEADER_SAFE, errors="surrogatepass")
    if client_salt is None:
        return namespace
    return f"{namespace}|salt:{quote(client_salt, safe='', errors='surrogatepass')}"


def engine_salt(tenant: Tenant, client_salt: str | None) -> str:
    """The cache_salt sent to a pool with `cache_salt: true`: the tenant scope's, and the
    client's own salt folded in when it sent one (so it still separates what the client
    separated)."""
    seed = tenant.cache_scope if client_salt is None else f"{tenant.cache_scope}\0{client_salt}"
    return xxhash.xxh3_128_hexdigest(seed.encode(errors="surrogatepass"))


class Planner:
    def __init__(
        self,
        config: GatewayConfig,
        registry: Registry,
        index: Index,
        reuse: ReuseCounter,
        metrics: Metrics,
        speculative: SpeculativeIndex | None = None,
    ) -> None:
        self._config = config
        self._speculative = speculative
        self._registry = registry
        self._index = index
        self._reuse = reuse
        self._metrics = metrics
        self._policy: Policy = config.routing.policy
        self._block_size = config.routing.block_size_tokens
        self._hasher = PrefixHasher()  # approximate mode: prompt text -> block hashes
        self._rng = random.Random(config.routing.seed)
        self._seq = 0
        self._precise = config.routing.mode == "precise"
        self._tokenizers = load_tokenizers(config) if self._precise else {}
        self.pinned = PinnedPoolWatch(metrics)
        self._keep_idle = {p.name: p.lend_keep_idle for p in config.pools if p.lend_keep_idle}
        # critical.clear_while_loading: replica -> monotonic time its latest critical request is
        # estimated to join the prefill queue (after its swap-in or remote fetch)
        self._critical_joins: dict[str, float] = {}

    @property
    def policy(self) -> Policy:
        return self._policy

    def set_pools(self, config: GatewayConfig, tokenizers: dict[str, PromptTokenizer]) -> None:
        """A reload changed the pools: their lending reserves, and (precise mode) their
        tokenizers (load_tokenizers, before anything changed)."""
        self._tokenizers = tokenizers
        self._keep_idle = {p.name: p.lend_keep_idle for p in config.pools if p.lend_keep_idle}

    def model_of(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("'model' is required and must be a string", param="model")
        status = self._registry.model_status(model)
        if status == "pending":
            raise ApiError(
                503,
                f"no replica serving model {model!r} has answered yet; retry shortly",
                code="model_not_ready",
                type="service_unavailable",
                param="model",
                headers={"retry-after": str(max(1, round(self._config.health.interval_s)))},
            )
        if status == "unknown":
            raise ApiError(
                404,
                f"the model {model!r} does not exist; GET /v1/models lists the served models",
                code="model_not_found",
                param="model",
            )
        return model

    async def plan(
        self,
        endpoint: str,
        body: dict[str, Any],
        tenant: Tenant,
        *,
        dry_run: bool = False,
        received_s: float | None = None,
    ) -> Plan:
        """Decide where one request goes, and gather what sending it needs.

        Hashes the prompt (approximate mode: the text of `body`'s messages or prompt; precise
        mode: the engine's token ids), looks the blocks up in the index, filters the model's
        healthy replicas by `tenant`'s class, calls decide() with the configured policy, and
        settles remote-tier admission (counting the prompt's reuse when that matters).

        `endpoint`: "chat" or "completions"; `body`: the parsed request body; `tenant`: who sent
        it; `received_s`: when it reached the gateway (perf_counter), for the client's TTFT in the
        estimate header. With `dry_run` (/debug/route) the decision is made the same way, but
        the request counter, the reuse counts, the critical tenants' bookkeeping and the fallback
        and admission metrics are left as they were. Nothing is written to the index here either way
        (record_sent does that once a replica accepted the request).

        Returns the Plan: the Decision (chosen replica and fallbacks), the hashes and namespace,
        the admission verdict, and the body to forward. An index that fails is routed around
        (no hits), never raised. Raises ApiError: 400 for a missing model or a malformed or
        too-long prompt, 404 for an unknown model, 503 when no healthy or eligible replica is
        left (the pinned pool down or full, per critical.fallback) or when batch traffic is shed.
        """
        started = time.perf_counter()
        model = self.model_of(body)
        client_salt = client_salt_of(body)
        cache_salt = engine_salt(tenant, client_salt)
        policy = self._policy
        if endpoint == "embeddings":  # no prefix reuse: by load alone, nothing hashed
            policy = Policy.LEAST_LOADED
            prompt_tokens = approx_tokens(prompt_of(endpoint, body))
            namespace = namespace_of(model, tenant, client_salt)
            hashes: list[int] = []
        elif self._precise:
            namespace, hashes, prompt_tokens = self._precise_prompt(
                endpoint, body, model, cache_salt, client_salt
            )
        else:
            text = prompt_of(endpoint, body)
            prompt_tokens = approx_tokens(text)
            namespace = namespace_of(model, tenant, client_salt)
            hashes = self._hasher.block_hashes(
                text, block_size_tokens=self._block_size, namespace=namespace
            )
        self._check_length(model, prompt_tokens, endpoint)
        if not self._registry.healthy_for(model):
            raise no_replica(model)
        hits = await self._lookup(model, hashes)
        decision, allowed = self._route(
            model, tenant, hashes, prompt_tokens, hits, dry_run=dry_run, policy=policy
        )
        chosen = self._registry.replicas[decision.replica]
        # Reuse counts feed remote-tier admission and prewarming only: with Redis they cost a
        # round trip, so a request whose pool has no remote tier skips them unless warming is on.
        family = family_key(hashes)
        reuse = 0
        if family is not None and (chosen.pool.remote_tier or self._config.prewarm.enabled):
            reuse = await (self._reuse.peek(family) if dry_run else self._reuse.seen(family))
        admission = self._admission(chosen, reuse, hits, prompt_tokens, dry_run=dry_run)
        return Plan(
            model=model,
            tenant=tenant,
            namespace=namespace,
            cache_salt=cache_salt,
            hashes=hashes,
            prompt_tokens=prompt_tokens,
            decision=decision,
            replicas=self._replicas_of(decision),
            fallback=allowed.fallback,
            admission=admission,
            reuse=reuse,
            decision_s=time.perf_counter() - started,
            body=body,
            stream=bool(body.get("stream")),
            hits=hits,
            endpoint=endpoint,
            received_s=received_s,
        )

    def replan(self, plan: Plan) -> Plan:
        """The same request decided again on the load of now (after it waited in flow control),
        with the index hits it looked up. Synchronous: the caller reserves right after."""
        started = time.perf_counter()
        # counted as a dry run: the first plan of this request was counted already
        decision, allowed = self._route(
            plan.model,
            plan.tenant,
            plan.hashes,
            plan.prompt_tokens,
            plan.hits,
            dry_run=True,
            policy=plan.decision.policy,
        )
        self._seq += 1
        chosen = self._registry.replicas[decision.replica]
        admission = self._admission(chosen, plan.reuse, plan.hits, plan.prompt_tokens, dry_run=True)
        return replace(
            plan,
            decision=decision,
            replicas=self._replicas_of(decision),
            fallback=allowed.fallback,
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
        self,
        model: str,
        tenant: Tenant,
        hashes: list[int],
        prompt_tokens: int,
        hits: BlockHits,
        *,
        dry_run: bool,
        policy: Policy | None = None,
    ) -> tuple[Decision, Eligibility]:
        """Filters, then decide(), then the critical spill and batch shedding. Synchronous.
        `policy`: the configured one unless given (embeddings go by load)."""
        policy = policy or self._policy
        replicas = self._registry.healthy_for(model)
        if not replicas:
            raise no_replica(model)
        now_s, stale_s = time.monotonic(), self._config.engine_metrics.stale_after_s
        klass = tenant.tenant_class
        cost_placement = self._config.critical.placement == "cost"
        allowed = eligible(
            [r.candidate(now_s, stale_s) for r in replicas],
            klass,
            self._config.critical.fallback,
            pinned_pool_exists=self._registry.has_pinned_pool(model),
            lend=not self.pinned.reclaimed(now_s),
            cost_placement=cost_placement,
            keep_idle=self._keep_idle,
        )
        if not allowed.candidates:
            if not dry_run and allowed.fallback is not None:
                self._metrics.critical_fallbacks.labels(allowed.fallback.value).inc()
            raise self._rejection(model, allowed.fallback)
        request = RouteRequest(hashes, prompt_tokens, self._block_size, ENGINE_PRIORITY[klass])
        decision = decide(request, allowed.candidates, hits, policy, seq=self._seq, rng=self._rng)
        budget = self._config.classes.critical.ttft_budget_ms
        if allowed.overflow and budget is not None and decision.est_ttft_s * 1000 > budget:
            # the pinned pool is too slow for this one: the shared pools, full cost model
            wider = decide(
                request,
                allowed.candidates + allowed.overflow,
                hits,
                policy,
                seq=self._seq,
                rng=self._rng,
            )
            if wider.replica not in {c.name for c in allowed.candidates}:
                decision, allowed = wider, replace(allowed, fallback=Fallback.SPILL)
        pressed = True  # a critical request off the pinned pool: did the pool lack headroom?
        if klass is TenantClass.CRITICAL and cost_placement:
            decision, allowed, pressed = self._cost_placed(decision, allowed)
        elif klass is not TenantClass.CRITICAL:
            decision = self._bounded_lending(request, decision, allowed, hits, now_s)
        if (
            klass is TenantClass.CRITICAL
            and not dry_run
            and self._config.critical.clear_while_loading
        ):
            est = decision.score().estimate
            if est.load_s > 0:
                join_s = now_s + est.fixed_s + est.load_s
                prior = self._critical_joins.get(decision.replica, 0.0)
                self._critical_joins[decision.replica] = max(prior, join_s)
        if not dry_run:
            self._seq += 1
            if allowed.fallback is not None:
                self._metrics.critical_fallbacks.labels(allowed.fallback.value).inc()
            if klass is TenantClass.CRITICAL and self._registry.has_pinned_pool(model):
                pool = self._registry.replicas[decision.replica].pool
                self.pinned.served(pool, now_s, pressed=pressed)
        if should_shed(decision, klass, self._config.overload.batch_max_queue_s):
            self._metrics.shed.labels(klass.value).inc()
            raise ApiError(
                503,
                "the fleet is overloaded and batch traffic is shed first; retry later",
                code="overloaded",
                type="service_unavailable",
                headers={"retry-after": str(self._config.critical.retry_after_s)},
            )
        return decision, allowed

    def _cost_placed(
        self, decision: Decision, allowed: Eligibility
    ) -> tuple[Decision, Eligibility, bool]:
        """critical.placement: cost. The cost model chose among pinned and shared replicas; a
        shared choice is a spill (counted as one). It says the pinned pool lacks headroom, and
        so stops lending, only when no pinned replica was under its admission cap: a follow-up
        that goes where its context is does not."""
        chosen = self._registry.replicas[decision.replica]
        if chosen.pool.pinned:
            return decision, allowed, False
        pinned = [c for c in allowed.candidates if c.pool.pinned]
        pressed = bool(pinned) and not any(admitted(c) for c in pinned)
        return decision, replace(allowed, fallback=Fallback.SPILL), pressed

    def _bounded_lending(
        self,
        request: RouteRequest,
        decision: Decision,
        allowed: Eligibility,
        hits: BlockHits,
        now_s: float,
    ) -> Decision:
        """A non-critical request lent a pinned replica prefills at most the pool's
        `lend_max_prefill_tokens` there (routing/filters.py lendable); with
        critical.clear_while_loading it does not go where it would join the prefill queue
        before a critical request still loading its KV (and so prefill ahead of it). Otherwise
        it is decided again without the replicas it may not use; if none is left, as decided."""
        joins = self._critical_joins
        for name in [r for r, t in joins.items() if t <= now_s]:
            del joins[name]

        def ok(c: Candidate) -> bool:
            score = decision.score(c.name)
            limit = self._registry.replicas[c.name].pool.lend_max_prefill_tokens
            if not lendable(c, score.overlap.uncached_tokens, limit):
                return False
            return joins.get(c.name, 0.0) <= now_s + score.estimate.load_s

        chosen = next(c for c in allowed.candidates if c.name == decision.replica)
        if ok(chosen):
            return decision
        kept = [c for c in allowed.candidates if ok(c)]
        if not kept:
            return decision
        return decide(request, kept, hits, decision.policy, seq=self._seq, rng=self._rng)

    def _precise_prompt(
        self,
        endpoint: str,
        body: dict[str, Any],
        model: str,
        cache_salt: str,
        client_salt: str | None = None,
    ) -> tuple[str, list[int], int]:
        """(namespace, block keys, prompt tokens) from the engine's own token ids. The salt the
        engine will hash with: the gateway's (pool `cache_salt: true`, the client's folded in),
        else the client's own, which then reaches the engine as it was sent."""
        from gateway.engines.tokenizer import UnsupportedPrompt

        pools = [r.pool for r in self._registry.replicas.values() if model in r.pool.models]
        salted = any(p.cache_salt for p in pools)
        namespace = precise_namespace(model, cache_salt if salted else client_salt)
        tokenizer = next((self._tokenizers[p.name] for p in pools), None)
        try:
            if tokenizer is None:
                raise UnsupportedPrompt(f"no pool names {model!r} with a tokenizer")
            if endpoint == "responses":  # the engine renders it as the chat it stands for
                messages = responses_messages(body.get("input"), body.get("instructions"))
                ids = tokenizer.chat_ids({**body, "messages": messages})
            elif endpoint == "chat":
                ids = tokenizer.chat_ids(body)
            else:
                ids = tokenizer.completion_ids(body)
        except UnsupportedPrompt as err:
            self._metrics.precise_fallbacks.labels("unsupported").inc()
            log.info("precise mode cannot tokenize this request (%s): routing without hits", err)
            return namespace, [], approx_tokens(prompt_of(endpoint, body))
        except PromptError as err:
            raise bad_request(str(err), param=PROMPT_PARAM.get(endpoint, "input")) from None
        hashes = token_block_hashes(ids, block_size_tokens=self._block_size, namespace=namespace)
        return namespace, hashes, len(ids)

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
            return ApiError(
                503,
                f"the pinned pool for {model!r} is down or at its admission cap",
                code="pinned_pool_unavailable",
                type="service_unavailable",
                headers={"retry-after": str(self._config.critical.retry_after_s)},
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
        self, replica: Replica, reuse: int, hits: BlockHits, prompt_tokens: int, *, dry_run: bool
    ) -> AdmissionVerdict | None:
        tier = replica.pool.remote_tier
        if tier is None or replica.pool.hbm_only:
            return None
        remote = Location(tier, Tier.REMOTE)
        held_blocks = next((i for i, h in enumerate(hits) if remote not in h), len(hits))
        verdict = should_write(
            prompt_tokens,
            held_blocks * self._block_size,
            len(hits) * self._block_size,  # the prefix any location holds: what was shared
            reuse,
            replica.costs,
            replica.terms,
        )
        if replica.pool.remote_write != "reuse":
            verdict = replace(
                verdict, write=replica.pool.remote_write == "always" and (verdict.new_tokens > 0)
            )
        if not dry_run:
            label = "admitted" if verdict.write else "refused"
            self._metrics.remote_admission.labels(label).inc()
            kv_bytes = verdict.new_tokens * replica.costs.kv_bytes_per_token
            if verdict.write:
                self._metrics.remote_bytes_written.inc(kv_bytes)
            else:
                self._metrics.remote_bytes_avoided.inc(kv_bytes)
        return verdict

    async def record_sent(self, plan: Plan, replica: Replica) -> None:
        """Approximate mode: after this request the replica holds the prompt's blocks in HBM;
        for a streamed request, the blocks it loads (swap-in, remote fetch) only from its first
        byte (record_loaded). Precise mode: the HBM hit prefix is refreshed and the rest marked
        speculative (see the module docstring). Either mode: the remote tier holds the prompt
        if the write was admitted, a streamed request's from its first byte (record_loaded)."""
        hbm = plan.hashes
        loading = self._loading(plan, replica)
        if loading is not None:
            hbm = plan.hashes[: loading.start] + plan.hashes[loading.stop :]
        if self._precise:
            hit_blocks = plan.decision.score(replica.name).overlap.hbm_tokens // self._block_size
            hbm = plan.hashes[:hit_blocks]
            if self._speculative is not None:
                where = Location(replica.name, Tier.HBM)
                self._speculative.speculate(plan.model, plan.hashes[hit_blocks:], where)
        try:
            if hbm:
                await record_prompt(self._index, plan.model, hbm, Location(replica.name, Tier.HBM))
            if not plan.stream:  # a whole answer comes after its prefill: the write is done
                await self._record_remote(plan, replica)
        except Exception as err:
            self._metrics.index_errors.labels("record").inc()
            log.warning("index record failed: %r", err)

    async def _record_remote(self, plan: Plan, replica: Replica) -> None:
        """The remote tier holds the prompt once the replica has written it: a KV connector
        saves the blocks a request computes during its prefill's forward pass (`save_kv_layer`
        per attention layer, `wait_for_save` as the pass ends:
        vllm/distributed/kv_transfer/kv_connector/v1/base.py), so a request elsewhere that
        looks for them before then finds none and recomputes the prompt."""
        tier = replica.pool.remote_tier
        if tier and plan.admission is not None and plan.admission.write:
            remote = Location(tier, Tier.REMOTE)
            await record_prompt(self._index, plan.model, plan.hashes, remote)

    def _loading(self, plan: Plan, replica: Replica) -> slice | None:
        """Approximate mode, a streamed request: the blocks it loads from the CPU or remote
        tier, which the engine holds in HBM only once they arrive. vLLM caches a block that a
        KV transfer fills only when the transfer is done (the scheduler allocates it with
        delay_cache_blocks while the request waits in WAITING_FOR_REMOTE_KVS:
        vllm/v1/core/kv_cache_manager.py `allocate_slots`, vllm/v1/core/sched/scheduler.py),
        so a request with the same prefix that arrives meanwhile loads them too. The blocks it
        computes are cached when its prefill is scheduled: a request queued behind it finds
        them. A whole answer's first byte comes after the generation: recorded at once."""
        if self._precise or not plan.stream:
            return None
        return plan.decision.score(replica.name).loaded_blocks(self._block_size)

    async def record_loaded(self, plan: Plan, replica: Replica) -> None:
        """At a streamed request's first byte: its prefill is done, every block of its prompt
        is in the replica's HBM, the loaded ones too (record_sent left them out), and in the
        remote tier if it was to write them there."""
        try:
            if self._loading(plan, replica) is not None:
                where = Location(replica.name, Tier.HBM)
                await record_prompt(self._index, plan.model, plan.hashes, where)
            await self._record_remote(plan, replica)
        except Exception as err:
            self._metrics.index_errors.labels("record").inc()
            log.warning("index record failed: %r", err)


def load_tokenizers(config: GatewayConfig) -> dict[str, PromptTokenizer]:
    """Each pool's tokenizer, read at start-up; a file that does not load is a ConfigError."""
    from gateway.engines.tokenizer import PromptTokenizer

    out: dict[str, PromptTokenizer] = {}
    for i, pool in enumerate(config.pools):
        t = pool.tokenizer
        if t is None:
            continue
        try:
            out[pool.name] = PromptTokenizer.from_files(
                t.path, t.chat_template, bos_token=t.bos_token, eos_token=t.eos_token
            )
        except Exception as err:
            raise ConfigError(f"pools.{i}.tokenizer: cannot load {t.path!r}: {err}") from None
    return out
