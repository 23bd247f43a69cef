"""The replicas behind the gateway: health, discovered models and the load the gateway put on them.

Load is tracked per request with a Reservation: in-flight count and uncached prefill tokens go up
when a request is sent; prefill tokens (and the CPU swap-in slot) come back at the first byte, the
in-flight slot at the end. Release is synchronous and idempotent, so a `finally` can always call
it, even while the task is being cancelled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

import httpx

from gateway.config import GatewayConfig, PoolConfig
from gateway.fleet import replica_auth
from gateway.fleet.engine_load import EngineLoad
from gateway.fleet.outliers import Backoff, Ejection
from gateway.fleet.step_watch import StepWatch
from routing.authority import EstimateError
from routing.cost import HBM_CAPACITY_TOKENS, CostTerms, Load, PoolCosts, Queued
from routing.decide import Candidate, PoolRules
from routing.hidden_tier import HiddenTier

log = logging.getLogger("cachelane.registry")

PREFILL_EWMA_WEIGHT = 0.1  # ~the last 10 requests: follows a workload shift within seconds


class Joining(NamedTuple):
    """A request sent to a replica and awaiting its first byte."""

    at_s: float  # perf_counter when its KV is loaded (the decision's swap and remote estimate)
    tokens: int  # uncached tokens it prefills
    swaps: bool  # it swaps KV in from the CPU tier
    priority: int | None = None  # the engine priority it was sent with; None: none


@dataclass
class Replica:
    name: str  # host:port, also the index's holder name
    url: str  # base URL without trailing slash
    pool: PoolConfig
    costs: PoolCosts
    rules: PoolRules
    healthy: bool = False
    consecutive_failures: int = 0  # failed health checks and dropped connections in a row
    consecutive_errors: int = 0  # passive health: 5xx, first-byte timeouts, broken connections
    ejection: Ejection | None = None  # out for how its requests went: back after a probe
    last_ejection: Ejection | None = None  # the one before: the back-off counts on from it
    ejection_reason: str | None = None  # why it was last taken out (metrics label)
    admitted_s: float = 0.0  # time.monotonic() when it was last admitted
    models: frozenset[str] = frozenset()
    model_cards: dict[str, dict[str, Any]] = field(default_factory=dict)  # its /v1/models, by id
    answered_check: bool = False  # has it ever passed a health check (its models are known)
    accepts_priority: bool | None = None  # took or refused a `priority` (fleet/engine_priority.py)
    in_flight: int = 0
    last_error: str | None = None
    retired: bool = False  # removed from the fleet (discovery, reload): its requests finish
    correction: float = 1.0  # routing.calibration: correction (gateway/accounting/calibration.py)
    terms: CostTerms | None = None  # in use (gateway/accounting/calibration.py); None: the seed
    engine: EngineLoad | None = None  # last scrape of the engine's own metrics
    mean_prefill_tokens: float = 0.0  # moving average of uncached tokens per request sent
    head_since_s: float = 0.0  # perf_counter when the prefill queue's current head started
    steps: StepWatch = field(default_factory=StepWatch)  # its engine steps, seen on streams
    estimate_error: EstimateError = field(default_factory=EstimateError)  # routing/authority.py
    hidden_tier: HiddenTier = field(default_factory=HiddenTier)  # its pool's (calibration.py)
    joining: dict[int, Joining] = field(default_factory=dict)  # by id() of the reservation

    @property
    def auth_headers(self) -> dict[str, str]:
        """The pool's credentials (pools[].api_key), on every call the gateway makes here."""
        return replica_auth.credentials(self.pool)

    def request_headers(self, own: Mapping[str, str]) -> dict[str, str]:
        """A proxied request's headers: the client headers the pool forwards, then the
        gateway's `own`, then the pool's credentials (a later one wins a name)."""
        return replica_auth.forwarded(self.pool) | dict(own) | self.auth_headers

    @property
    def awaiting_first_byte(self) -> int:
        """Requests sent and not yet past their first byte."""
        return len(self.joining)

    @property
    def pending_prefill_tokens(self) -> int:
        """Uncached prompt tokens of the requests awaiting their first byte."""
        return sum([j.tokens for j in self.joining.values()])  # a list: asked per decision

    def token_seen(self, at_s: float, previous_s: float | None) -> None:
        """A token of one of its streams came at `at_s` (perf_counter), the stream's previous
        one at `previous_s`: the gap was a step of decodes alone when none of this gateway's
        requests was prefilling meanwhile."""
        alone = previous_s is not None and not self.joining and previous_s >= self.head_since_s
        self.steps.token(at_s, previous_s if alone else None)

    def load(self, now_s: float, stale_after_s: float) -> Load:
        """The gateway's own counts, raised to what the engine reports when its scrape is fresh:
        requests other gateways sent show up only there. Their prompt sizes are unknown, so
        each is charged this gateway's mean uncached prompt."""
        # list comprehensions, not generators: every decision asks every candidate's load
        now = time.perf_counter()
        joining = self.joining.values()
        queue = tuple([Queued(j.at_s - now, j.tokens, j.priority) for j in joining])
        in_flight, pending = self.in_flight, self.pending_prefill_tokens
        e = self.engine
        if e is not None and now_s - e.scraped_at_s <= stale_after_s:
            in_flight = max(in_flight, round(e.running + e.waiting))
            # the engine's waiting count is as of the scrape: take out what was ours then, not
            # now (a request of ours that has finished since would count as someone else's)
            foreign_waiting = max(0.0, e.waiting - max(e.own_waiting, self.awaiting_first_byte))
            pending += round(foreign_waiting * self.mean_prefill_tokens)
        busy_s = 0.0
        swapping = 0
        if queue:
            # the head started when the previous one finished, or when it was loaded, if later
            loaded = min([j.at_s for j in joining])
            busy_s = max(0.0, now - max(self.head_since_s, loaded))
            swapping = sum([1 for j in joining if j.swaps and j.at_s > now])
        ago_s, step_s, for_s = self.steps.seen(now)
        return Load(in_flight, pending, swapping, busy_s, queue, ago_s, step_s, for_s)

    def hbm_capacity_tokens(self) -> int:
        """The config's figure, else what the engine reports, else the default."""
        if self.pool.hbm_capacity_tokens is not None:
            return self.pool.hbm_capacity_tokens
        reported = self.engine.hbm_capacity_tokens if self.engine is not None else None
        return reported if reported is not None else HBM_CAPACITY_TOKENS

    def observe_engine(self, scraped: EngineLoad, block_size_tokens: int | None = None) -> None:
        """Take a scrape of the engine's metrics; say once when its KV layout disagrees with the
        config (a wrong block size makes every hash miss in precise mode)."""
        first_layout = scraped.gpu_blocks is not None and (
            self.engine is None or self.engine.gpu_blocks != scraped.gpu_blocks
        )
        self.engine = scraped
        if not first_layout:
            return
        log.info(
            "replica %s: the engine holds %d KV blocks of %s tokens in HBM (%s)",
            self.name,
            scraped.gpu_blocks,
            scraped.block_size_tokens,
            "used as its HBM capacity"
            if self.pool.hbm_capacity_tokens is None
            else f"the config says {self.pool.hbm_capacity_tokens} tokens",
        )
        size = scraped.block_size_tokens
        if block_size_tokens is not None and size is not None and size != block_size_tokens:
            log.warning(
                "replica %s: the engine's block size is %d tokens, routing.block_size_tokens is "
                "%d: set them equal, or prefix hits will be mispredicted",
                self.name,
                size,
                block_size_tokens,
            )

    def candidate(self, now_s: float, stale_after_s: float) -> Candidate:
        tier = None if self.pool.hbm_only else self.pool.remote_tier or self.hidden_tier.tier
        return Candidate(
            name=self.name,
            load=self.load(now_s, stale_after_s),
            costs=self.costs,
            remote_tier=tier,
            terms=self.terms,
            pool=self.rules,
            estimate_band=self.estimate_error.band(),
        )


def _no_listener() -> None:
    pass


class LoadListener(Protocol):
    """Hears of every reservation's steps (gateway/fleet/siblings.py: the other workers' view)."""

    def reserved(self, reservation: Reservation, joining: Joining) -> None: ...

    def first_byte(self, reservation: Reservation) -> None: ...

    def released(self, reservation: Reservation) -> None: ...


@dataclass
class Reservation:
    replica: Replica
    on_drop: Callable[[], None] = _no_listener  # told whenever this reservation's load drops
    started_s: float = field(default_factory=time.perf_counter)
    first_byte_s: float | None = None
    done: bool = False
    listener: LoadListener | None = None

    def first_byte(self, *, step_end: bool = True) -> float:
        """Mark the first byte from the replica; returns the observed TTFT in seconds.
        `step_end`: a first token, from a step's end (an answer read whole ends later)."""
        if self.first_byte_s is None:
            self.first_byte_s = time.perf_counter()
            self._prefill_done(self.first_byte_s, step_end)
            if self.listener is not None:
                self.listener.first_byte(self)
            self.on_drop()
        return self.first_byte_s - self.started_s

    def release(self) -> None:
        if self.done:
            return
        self.done = True
        if self.first_byte_s is None:
            self._prefill_done(time.perf_counter(), step_end=False)
            self.first_byte_s = -1.0
        self.replica.in_flight -= 1
        if self.listener is not None:
            self.listener.released(self)
        self.on_drop()

    def _prefill_done(self, now_s: float, step_end: bool) -> None:
        r = self.replica
        r.joining.pop(id(self), None)
        r.head_since_s = now_s  # a serial prefill moves on to the next request in its queue
        if step_end:
            r.token_seen(now_s, None)
            end_s = r.steps.end_s  # the next head joins the step formed then
            r.head_since_s = end_s if end_s is not None else now_s


def replica_name(url: str) -> str:
    return httpx.URL(url).netloc.decode()


def _rules_of(pool: PoolConfig, accepts_priority: bool | None = None) -> PoolRules:
    return PoolRules(
        name=pool.name,
        pinned=pool.pinned,
        hbm_only=pool.hbm_only,
        max_in_flight=pool.admission.max_in_flight,
        max_prefill_tokens=pool.admission.max_prefill_tokens,
        lend_below=pool.lend_below,
        engine_priority=pool.engine_priority and accepts_priority is not False,
    )


class Registry:
    def __init__(
        self,
        config: GatewayConfig,
        on_change: Callable[[Replica, bool], Awaitable[None]] | None = None,
    ) -> None:
        self.replicas: dict[str, Replica] = {}
        self._fail_after = config.health.fail_after
        self._eject_after_errors = config.health.eject_after_errors
        h = config.health
        self.backoff = Backoff(h.ejection_s, h.ejection_factor, h.max_ejection_s)
        self._on_change = on_change
        self.on_load_change: Callable[[], None] = _no_listener  # flow control's kick
        self.load_listener: LoadListener | None = (
            None  # the sibling workers (gateway/fleet/siblings.py)
        )
        self.pool_models = frozenset(m for p in config.pools for m in p.models)  # Fleet updates
        for pool in config.pools:
            for raw in pool.replicas:
                self.add(str(raw), pool)

    def add(self, url: str, pool: PoolConfig) -> Replica:
        """A replica joins (unhealthy until its first health check passes)."""
        url = url.rstrip("/")
        replica = Replica(
            replica_name(url),
            url,
            pool,
            pool.costs.to_pool_costs(pool.engine),
            _rules_of(pool),
            models=frozenset(pool.models),
        )
        self.replicas[replica.name] = replica
        return replica

    def readmit(self, replica: Replica) -> None:
        """A replica removed while its requests were still finishing joins again, as it was
        (its load counts stay right); unhealthy until its next health check passes."""
        replica.retired = False
        replica.healthy = False
        self.replicas[replica.name] = replica

    def remove(self, name: str) -> Replica | None:
        """A replica leaves: no new request goes to it (it counts as unhealthy, and no health
        check re-admits it); those in flight finish. Returns it, or None if it was not here."""
        replica = self.replicas.pop(name, None)
        if replica is not None:
            replica.retired = True
            replica.healthy = False
        return replica

    @staticmethod
    def move(replica: Replica, pool: PoolConfig) -> None:
        """The replica's pool changed (a reload): its rules and cost seed follow; the models it
        serves are the pool's, or, for a pool that names none, those it already listed."""
        replica.pool = pool
        replica.costs = pool.costs.to_pool_costs(pool.engine)
        replica.rules = _rules_of(pool, replica.accepts_priority)
        if pool.models:
            replica.models = frozenset(pool.models)

    def reserve(
        self,
        replica: Replica,
        *,
        prefill_tokens: int,
        swaps: int,
        load_s: float = 0.0,
        priority: int | None = None,
    ) -> Reservation:
        """Count a request sent to `replica` until its first byte (and its end); `load_s` is
        how long its KV takes to load (swap-in, remote fetch) before it waits for the prefill;
        `priority`: the engine priority it carries, if its pool schedules by it."""
        now = time.perf_counter()
        if not replica.awaiting_first_byte:
            replica.head_since_s = now
        replica.in_flight += 1
        replica.mean_prefill_tokens += PREFILL_EWMA_WEIGHT * (
            prefill_tokens - replica.mean_prefill_tokens
        )
        reservation = Reservation(replica, on_drop=self.on_load_change, listener=self.load_listener)
        joining = Joining(now + load_s, prefill_tokens, swaps > 0, priority)
        replica.joining[id(reservation)] = joining
        if self.load_listener is not None:
            self.load_listener.reserved(reservation, joining)
        self.on_load_change()  # after the reservation counts: flow control reads the load
        return reservation

    def known_models(self) -> set[str]:
        """The models the replicas serve, and those a pool names (served again once its
        replicas are back: a discovered pool may have none for a while)."""
        return {m for r in self.replicas.values() for m in r.models} | self.pool_models

    def model_status(self, model: str) -> Literal["known", "pending", "unknown"]:
        """ "known": a pool names it or a replica said it serves it; "pending": not (yet), but a
        replica whose pool lists no models has not answered its first health check, so it may
        (a 503 with Retry-After, which clients retry, rather than a 404); else "unknown"."""
        if model in self.known_models():
            return "known"
        if any(not r.pool.models and not r.answered_check for r in self.replicas.values()):
            return "pending"
        return "unknown"

    def model_cards(self) -> dict[str, dict[str, Any]]:
        """Every known model's /v1/models entry: the engine's own (its fields passed through, a
        healthy replica's first), else a bare one for a model a pool names that no replica has
        listed yet."""
        cards: dict[str, dict[str, Any]] = {}
        ordered = sorted(self.replicas.values(), key=lambda r: not r.healthy)
        for replica in ordered:
            for model in sorted(replica.models):
                card = replica.model_cards.get(model)
                if card is not None and model not in cards:
                    cards[model] = {**card, "id": model}
        for model in self.known_models() - cards.keys():
            cards[model] = {"id": model, "object": "model", "created": 0, "owned_by": "cachelane"}
        return dict(sorted(cards.items()))

    def healthy_for(self, model: str) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy and model in r.models]

    def has_pinned_pool(self, model: str) -> bool:
        return any(r.pool.pinned and model in r.models for r in self.replicas.values())

    def max_prompt_tokens(self, model: str) -> int | None:
        """The smallest limit of any pool serving the model (None: no limit configured)."""
        limits = [
            r.pool.max_prompt_tokens
            for r in self.replicas.values()
            if model in r.models and r.pool.max_prompt_tokens
        ]
        return min(limits) if limits else None

    async def mark_failed(self, replica: Replica, error: str) -> None:
        """Count a failed health check; `health.fail_after` in a row take the replica out."""
        replica.consecutive_failures += 1
        replica.last_error = error
        if replica.consecutive_failures >= self._fail_after:
            await self._eject(replica, error, "health_check")

    async def unreachable(self, replica: Replica, error: str) -> None:
        """A request could not connect to the replica: out at once, back after its back-off
        and a probe (gateway/fleet/outliers.py)."""
        replica.consecutive_failures += 1
        replica.last_error = error
        await self._eject_by_outcome(replica, error, "connect")

    async def answered(self, replica: Replica, status: int) -> None:
        """Passive health, like Envoy's outlier detection (consecutive_5xx): a replica's own
        traffic tells how it answers. A 5xx counts an error, anything else resets the count;
        `health.eject_after_errors` errors in a row eject it for at least `health.ejection_s`."""
        if status < 500:
            replica.consecutive_errors = 0
            return
        await self.errored(replica, f"answered {status}", reason="5xx")

    async def errored(self, replica: Replica, error: str, *, reason: str) -> None:
        """Count a passive error (a 5xx answer, `reason` "5xx"; no first byte in time,
        "timeout") toward `health.eject_after_errors`."""
        replica.consecutive_errors += 1
        replica.last_error = error
        limit = self._eject_after_errors
        if limit and replica.consecutive_errors >= limit and replica.healthy:
            await self._eject_by_outcome(
                replica, f"{replica.consecutive_errors} errors in a row, last: {error}", reason
            )

    async def _eject_by_outcome(self, replica: Replica, error: str, reason: str) -> None:
        if not replica.healthy or replica.retired:
            return
        stayed_s = time.monotonic() - replica.admitted_s
        previous = replica.last_ejection
        replica.ejection = self.backoff.eject(previous, reason, error, stayed_s=stayed_s)
        await self._eject(replica, error, reason)

    async def _eject(self, replica: Replica, error: str, reason: str) -> None:
        if not replica.healthy:
            return
        replica.healthy = False
        replica.ejection_reason = reason
        ejection = replica.ejection
        if ejection is not None and ejection.reason == reason:
            log.warning(
                "replica %s ejected (%s, %d in a row, probed in %.1f s): %s",
                replica.name,
                reason,
                ejection.count,
                ejection.probe_at_s - time.monotonic(),
                error,
            )
        else:
            log.warning("replica %s ejected (%s): %s", replica.name, reason, error)
        if self._on_change is not None:
            await self._on_change(replica, False)

    def probe_due(self, replica: Replica) -> bool:
        """Whether a replica ejected for its requests has sat out its back-off (half open)."""
        e = replica.ejection
        return not replica.healthy and e is not None and time.monotonic() >= e.probe_at_s

    async def probed(self, replica: Replica, error: str | None) -> None:
        """The outcome of a half-open replica's probe generation (`error`: None if it passed):
        full traffic again, or out for the next back-off."""
        e = replica.ejection
        if e is None or replica.healthy or replica.retired:
            return
        if error is not None:
            self.backoff.probe_failed(e, error)
            replica.last_error = f"probe: {error}"
            log.warning(
                "replica %s failed its probe (%s): out for %.1f s more",
                replica.name,
                error,
                e.probe_at_s - time.monotonic(),
            )
            return
        log.info("replica %s passed its probe after %d ejection(s) in a row", replica.name, e.count)
        await self._admit(replica)

    async def _admit(self, replica: Replica) -> None:
        replica.consecutive_errors = 0
        replica.consecutive_failures = 0
        replica.last_error = None
        replica.healthy = True
        replica.admitted_s = time.monotonic()
        if replica.ejection is not None:
            replica.last_ejection, replica.ejection = replica.ejection, None
        log.info("replica %s admitted, models %s", replica.name, sorted(replica.models))
        if self._on_change is not None:
            await self._on_change(replica, True)
        replica.ejection_reason = None  # told: the re-admission's metric label

    async def mark_ok(
        self,
        replica: Replica,
        models: frozenset[str],
        cards: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Record a passed check (`cards`: the engine's /v1/models entries by id); a replica
        that was out is (re)admitted, unless it was ejected for how its requests went: only a
        probe generation re-admits that one (`probed`)."""
        if replica.retired:  # a check that was under way when it left
            return
        if cards is not None:
            replica.model_cards = cards
        replica.answered_check = True
        if not replica.pool.models:
            replica.models = models
        if replica.ejection is not None and not replica.healthy:
            return
        replica.consecutive_failures = 0  # a check says nothing of how it answers requests:
        replica.last_error = None  # consecutive_errors is reset by an answer, or re-admission
        if not replica.healthy:
            await self._admit(replica)
