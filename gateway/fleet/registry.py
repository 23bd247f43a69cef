"""The replicas behind the gateway: health, discovered models and the load the gateway put on them.

Each replica, and each request's hold on its load, is a gateway/fleet/replica.py record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import httpx

from gateway.config import GatewayConfig, PoolConfig
from gateway.fleet.outliers import Backoff
from gateway.fleet.replica import (
    Joining,
    LoadListener,
    Replica,
    Reservation,
    no_listener,
)
from routing.decide import PoolRules

log = logging.getLogger("cachelane.registry")

PREFILL_EWMA_WEIGHT = 0.1  # ~the last 10 requests: follows a workload shift within seconds


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
        self.on_load_change: Callable[[], None] = no_listener  # flow control's kick
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

    async def answered(self, replica: Replica, status: int, *, tenant: str) -> None:
        """Passive health, like Envoy's outlier detection (consecutive_5xx): a replica's own
        traffic tells how it answers. A 5xx counts an error (of `tenant`'s request), anything
        else resets the count; `health.eject_after_errors` errors in a row eject it for at least
        `health.ejection_s` (`errored` says when)."""
        if status < 500:
            replica.errors.forgive()
            return
        await self.errored(replica, f"answered {status}", reason="5xx", tenant=tenant)

    async def errored(self, replica: Replica, error: str, *, reason: str, tenant: str) -> None:
        """Count a passive error of `tenant`'s request (a 5xx answer, `reason` "5xx"; no first
        byte in time, "timeout"; a broken connection, "disconnect") toward
        `health.eject_after_errors`: several tenants' eject the replica, one tenant's alone make
        it a suspect that the health checker probes (`confirmed`; gateway/fleet/outliers.py)."""
        replica.last_error = error
        was_suspect = replica.suspect is not None
        error = f"{replica.errors.count + 1} errors in a row, last: {error}"
        limit = self._eject_after_errors if replica.healthy else 0  # out: its probe decides
        if replica.errors.add(tenant, reason, error, limit):
            await self._eject_by_outcome(replica, error, reason)
        elif replica.suspect is not None and not was_suspect:
            log.warning("replica %s is a suspect, its probe decides: %s", replica.name, error)

    async def confirmed(self, replica: Replica, error: str | None) -> None:
        """The outcome of a suspect replica's probe generation (`error`: None if it passed): a
        replica that answers the gateway's own request was not at fault, and its count starts
        over; one that fails it is ejected for the errors that made it a suspect."""
        suspect, replica.errors.suspect = replica.suspect, None
        if suspect is None or not replica.healthy or replica.retired:
            return
        if error is None:
            log.info("replica %s passed its probe: its failed requests were theirs", replica.name)
            replica.errors.forgive()
            return
        reason, errors = suspect
        await self._eject_by_outcome(replica, f"{errors}; probe: {error}", reason)

    async def _eject_by_outcome(self, replica: Replica, error: str, reason: str) -> None:
        if not replica.healthy or replica.retired:
            return
        replica.errors.suspect = None  # out: the back-off's probe decides now
        stayed_s = time.monotonic() - replica.admitted_s
        previous = replica.last_ejection
        replica.ejection = self.backoff.eject(previous, reason, error, stayed_s=stayed_s)
        await self._eject(replica, error, reason)

    async def _eject(self, replica: Replica, error: str, reason: str) -> None:
        if not replica.healthy:
            return
        replica.healthy = False
        replica.first_bytes_lost()
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
        replica.errors.forgive()
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
