"""Active health checks: every replica's /v1/models on an interval, and the probe generation that
lets a replica ejected for how its requests went back in (gateway/fleet/outliers.py), or that
decides whether a suspect, which failed requests of one tenant only, is ejected
(Registry.errored)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

import httpx

from gateway.fleet import engine_priority
from gateway.fleet.registry import Registry
from gateway.fleet.replica import Replica
from gateway.serving.deadline import first_byte_deadline_s

log = logging.getLogger("cachelane.registry")

PROBE_PROMPT = engine_priority.PROBE_PROMPT  # any prompt: one token is generated, thrown away


async def probe(
    client: httpx.AsyncClient, replica: Replica, timeout_s: float
) -> dict[str, dict[str, Any]]:
    """One active health check: GET /v1/models (any OpenAI-compatible server answers it).
    Returns the engine's entries by model id, as it sent them."""
    resp = await client.get(
        f"{replica.url}/v1/models", timeout=timeout_s, headers=replica.auth_headers
    )
    resp.raise_for_status()
    data = resp.json().get("data", [])
    return {str(m["id"]): m for m in data if isinstance(m, dict) and "id" in m}


def _refused_credentials(err: Exception) -> int | None:
    """401 or 403 when the replica answered a health check by refusing its caller."""
    if isinstance(err, httpx.HTTPStatusError) and err.response.status_code in (401, 403):
        return err.response.status_code
    return None


async def probe_generation(client: httpx.AsyncClient, replica: Replica, timeout_s: float) -> None:
    """One real generation of one token on the replica (/v1/completions, which every
    OpenAI-compatible engine serves without a chat template); raises httpx.HTTPError (a 4xx or
    5xx answer included) or ValueError (an answer that is not a completion)."""
    model = min(replica.models) if replica.models else ""
    body = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "stream": False}
    resp = await client.post(
        f"{replica.url}/v1/completions",
        json=body,
        timeout=timeout_s,
        headers=replica.auth_headers,
    )
    resp.raise_for_status()
    answer = resp.json()
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        raise ValueError(f"not a completion: {resp.text[:200]!r}")


def _asks_priority(replica: Replica) -> bool:
    """A replica of a pool that sends `priority` is asked whether its engine takes it when a
    check admits it (new, or back after failed checks: perhaps restarted with other flags), and
    at each check while the answer is not known."""
    if not replica.pool.engine_priority:
        return False
    admitting = not replica.healthy and replica.ejection is None
    return admitting or replica.accepts_priority is None


class HealthChecker:
    """Checks every replica on an interval: ejects after `fail_after` failures in a row,
    re-admits after one pass; a replica ejected for how its requests went is re-admitted only
    by a probe generation once its back-off is over (gateway/fleet/outliers.py), sent in a task of
    its own so a hung replica does not hold the other checks up."""

    def __init__(
        self,
        registry: Registry,
        client: httpx.AsyncClient,
        *,
        interval_s: float,
        timeout_s: float,
        on_probe: Callable[[Replica, bool], None] | None = None,
    ) -> None:
        self._registry = registry
        self._client = client
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._on_probe = on_probe  # told each probe's outcome (passed or not): a metric
        self._probes: asyncio.TaskGroup | None = None  # run()'s: probes end with it
        self._probing: set[str] = set()

    async def check_all(self) -> None:
        await self.check(list(self._registry.replicas.values()))

    async def check(self, replicas: Iterable[Replica]) -> None:
        """Check these replicas now (one that just joined need not wait for the next round)."""
        await asyncio.gather(*(self._check(r) for r in replicas))

    async def _check(self, replica: Replica) -> None:
        try:
            cards = await probe(self._client, replica, self._timeout_s)
        except (httpx.HTTPError, ValueError, AttributeError) as err:
            refused = _refused_credentials(err)
            if refused is not None and replica.last_error != f"health check: {err!r}":
                log.warning(  # said when it starts; the key itself is never logged
                    "replica %s refused the gateway's credentials (%d): %s; it gets no "
                    "traffic until it accepts them",
                    replica.name,
                    refused,
                    "set the key it was started with (vLLM --api-key) as its pool's api_key"
                    if replica.pool.api_key is None
                    else "its pool's api_key is not the key the replica expects",
                )
            elif not replica.answered_check and replica.last_error is None:  # said once
                log.warning(
                    "replica %s cannot be reached (%r); it gets no traffic until it answers",
                    replica.name,
                    err,
                )
            await self._registry.mark_failed(replica, f"health check: {err!r}")
            return
        if _asks_priority(replica):  # before it takes traffic (unanswered: as its pool says)
            await self._ask_priority(replica, cards)
        await self._registry.mark_ok(replica, frozenset(cards), cards)
        suspect = replica.healthy and replica.suspect is not None
        due = suspect or self._registry.probe_due(replica)
        if due and replica.name not in self._probing:
            self._probing.add(replica.name)
            if self._probes is None:
                await self._probe(replica, suspect=suspect)
            else:
                generation = self._probe(replica, suspect=suspect)
                self._probes.create_task(generation, name=f"probe {replica.name}")

    async def _ask_priority(self, replica: Replica, cards: dict[str, dict[str, Any]]) -> None:
        """Whether the replica's engine takes `priority` (gateway/fleet/engine_priority.py),
        within a health check's timeout; a failed question is asked again at the next check."""
        models = replica.pool.models or sorted(cards)
        if not models:
            return
        try:
            accepted = await engine_priority.accepts_priority(
                self._client, replica.url, min(models), replica.auth_headers, self._timeout_s
            )
        except (httpx.HTTPError, ValueError) as err:  # asked again at the next check
            log.debug("replica %s: not asked whether it takes `priority`: %r", replica.name, err)
            return
        engine_priority.record(replica, accepted, "probe")

    async def _probe(self, replica: Replica, *, suspect: bool) -> None:
        """One probe generation, due within a one-token whole answer's deadline: of a suspect
        (its outcome decides whether it is ejected) or of a replica whose back-off is over."""
        deadline_s = first_byte_deadline_s(  # its one-word prompt: an estimate of nothing
            replica.pool,
            stream=False,
            endpoint="completions",
            body={"max_tokens": 1},
            card=None,
            estimate_s=0.0,
        )
        try:
            await probe_generation(self._client, replica, deadline_s or self._timeout_s)
            error = None
        except (httpx.HTTPError, ValueError) as err:
            error = repr(err)
        except Exception as err:  # never the end of run()'s task group: a failed probe
            log.exception("probe of replica %s failed unexpectedly", replica.name)
            error = repr(err)
        finally:
            self._probing.discard(replica.name)
        if self._on_probe is not None:
            self._on_probe(replica, error is None)
        try:
            if suspect:  # (Registry.errored): never a re-admission, if it was ejected since
                await self._registry.confirmed(replica, error)
            else:
                await self._registry.probed(replica, error)
        except Exception:  # the health checks go on; the replica is probed again
            log.exception("could not record the probe of replica %s", replica.name)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as probes:
            self._probes = probes
            try:
                while True:
                    await asyncio.sleep(self._interval_s)
                    await self.check_all()
            finally:
                self._probes = None
