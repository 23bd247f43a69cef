"""A replica as the gateway knows it (health, discovered models, load, its engine's steps), and a
request's hold on its load (Reservation; the Registry in gateway/fleet/registry.py makes both).

Load is tracked per request with a Reservation: in-flight count and uncached prefill tokens go up
when a request is sent; prefill tokens (and the CPU swap-in slot) come back at the first byte, the
in-flight slot at the end. Release is synchronous and idempotent, so a `finally` can always call
it, even while the task is being cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from gateway.config import PoolConfig
from gateway.fleet import replica_auth
from gateway.fleet.engine_load import EngineLoad
from gateway.fleet.outliers import Ejection, ErrorRun
from gateway.fleet.step_watch import StepWatch
from routing.authority import EstimateError
from routing.cost import HBM_CAPACITY_TOKENS, CostTerms, Load, PoolCosts, Queued
from routing.decide import Candidate, PoolRules
from routing.hidden_tier import HiddenTier

log = logging.getLogger("cachelane.registry")


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
    # passive health: 5xx answers, first-byte timeouts and broken connections in a row
    errors: ErrorRun = field(default_factory=ErrorRun)
    # out for how its requests went: re-admitted only by a probe, after its back-off
    ejection: Ejection | None = None
    last_ejection: Ejection | None = None  # the one before: the back-off counts on from it
    ejection_reason: str | None = None  # why it was last taken out (metrics label)
    admitted_s: float = 0.0  # time.monotonic() when it was last admitted
    models: frozenset[str] = frozenset()
    # the engine's own /v1/models entries by id (max_model_len, owned_by, root, ...), as last seen
    model_cards: dict[str, dict[str, Any]] = field(default_factory=dict)
    answered_check: bool = False  # has it ever passed a health check (its models are known)
    accepts_priority: bool | None = None  # took or refused a `priority` (fleet/engine_priority.py)
    in_flight: int = 0
    last_error: str | None = None
    retired: bool = False  # removed from the fleet (discovery, reload): its requests finish
    correction: float = 1.0  # routing.calibration: correction (gateway/accounting/calibration.py)
    terms: CostTerms | None = (
        None  # cost terms in use (gateway/accounting/calibration.py); None: the seed
    )
    engine: EngineLoad | None = None  # last scrape of the engine's own metrics
    mean_prefill_tokens: float = 0.0  # moving average of uncached tokens per request sent
    head_since_s: float = 0.0  # perf_counter when the prefill queue's current head started
    steps: StepWatch = field(default_factory=StepWatch)  # its engine steps, seen on streams
    estimate_error: EstimateError = field(default_factory=EstimateError)  # routing/authority.py
    hidden_tier: HiddenTier = field(default_factory=HiddenTier)  # its pool's (calibration.py)
    # Requests awaiting their first byte, keyed by id() of the reservation.
    joining: dict[int, Joining] = field(default_factory=dict)
    # the deadlines of the tries waiting for its first byte (`awaiting`)
    first_byte_deadlines: set[asyncio.Timeout] = field(default_factory=set)

    @contextlib.contextmanager
    def awaiting(self, deadline: asyncio.Timeout) -> Iterator[None]:
        """A try waits for its first byte from here under `deadline`, which `first_bytes_lost`
        ends at once."""
        self.first_byte_deadlines.add(deadline)
        try:
            yield
        finally:
            self.first_byte_deadlines.discard(deadline)

    def first_bytes_lost(self) -> None:
        """It went down: every try waiting for its first byte here times out now, and is tried
        on the next replica (a replica marked down answers none of them)."""
        now = asyncio.get_running_loop().time()
        for deadline in list(self.first_byte_deadlines):
            when = deadline.when()
            if when is None or when > now:
                deadline.reschedule(now)

    @property
    def consecutive_errors(self) -> int:
        return self.errors.count

    @property
    def suspect(self) -> tuple[str, str] | None:
        """(reason, error) of errors of one tenant's requests, until a probe decides."""
        return self.errors.suspect

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


def no_listener() -> None:
    """Told nothing."""
    pass


class LoadListener(Protocol):
    """Hears of every reservation's steps (gateway/fleet/siblings.py: the other workers' view)."""

    def reserved(self, reservation: Reservation, joining: Joining) -> None: ...

    def first_byte(self, reservation: Reservation) -> None: ...

    def released(self, reservation: Reservation) -> None: ...


@dataclass
class Reservation:
    replica: Replica
    on_drop: Callable[[], None] = no_listener  # told whenever this reservation's load drops
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
