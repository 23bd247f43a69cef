"""`cachelane check-config --probe`: ask each replica a config names what the gateway would ask
it: its models (GET /v1/models) and, where its pool sends classes as `priority`, whether its
engine takes one (gateway/fleet/engine_priority.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from gateway.config import GatewayConfig
from gateway.fleet import engine_priority, replica_auth

PROBE_TIMEOUT_S = 10.0  # a one-token generation on an idle engine takes milliseconds


@dataclass(frozen=True)
class Probed:
    replica: str
    line: str  # what it answered
    warning: str | None = None  # what to look at
    refuses_priority: bool = False  # its pool sends `priority`, its engine refuses it


async def _probe(client: httpx.AsyncClient, config: GatewayConfig) -> list[Probed]:
    async def one(url: str, pool_index: int) -> Probed:
        pool = config.pools[pool_index]
        headers = replica_auth.credentials(pool)
        try:
            resp = await client.get(f"{url}/v1/models", headers=headers)
            resp.raise_for_status()
            served = sorted(str(m["id"]) for m in resp.json().get("data", []) if "id" in m)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
            return Probed(url, f"unreachable ({err!r})", f"{url}: does not answer /v1/models")
        line = f"models {', '.join(served) or '(none)'}"
        if not pool.engine_priority or not (pool.models or served):
            return Probed(url, line)
        model = min(pool.models or served)
        try:
            accepted = await engine_priority.accepts_priority(
                client, url, model, headers, PROBE_TIMEOUT_S
            )
        except httpx.HTTPError as err:
            return Probed(url, f"{line}; priority not answered ({err!r})")
        if accepted:
            return Probed(url, f"{line}; takes `priority`")
        return Probed(
            url,
            f"{line}; refuses `priority`",
            f"pools.{pool_index} ({pool.name!r}) sets engine_priority but {url} refuses "
            "`priority` (its engine runs fcfs): the gateway will send it none; start the engine "
            "with --scheduling-policy priority, or set engine_priority: false",
            refuses_priority=True,
        )

    jobs = [
        one(str(url).rstrip("/"), i) for i, pool in enumerate(config.pools) for url in pool.replicas
    ]
    return list(await asyncio.gather(*jobs))


def probe_replicas(config: GatewayConfig) -> list[Probed]:
    """Every replica the config lists (not those found by discovery), asked at once."""

    async def run() -> list[Probed]:
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S) as client:
            return await _probe(client, config)

    return asyncio.run(run())
