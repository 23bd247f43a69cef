"""Replicas that require a key (vLLM --api-key; the simulator's --api-key): the pool's api_key
goes on every call the gateway makes to them, and only the client headers a pool names go along.

Real servers on loopback: simulated replicas started with an api_key, each wrapped in a recorder
that keeps the headers of every request it received (it changes nothing), behind a real gateway,
driven by the official openai client."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.http.app import create_app
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from tests.helpers.servers import running_app
from tests.helpers.waiting import poll_until
from tests.integration.fleet import FAST_COSTS, MODEL, gateway_config

REPLICA_KEY = "replica-key-" + "7" * 40
TENANT_KEY = "tenant-key-" + "3" * 40
ADMIN_KEY = "admin-key-" + "4" * 40
WAIT_S = 10.0  # for health checks and scrapes on 0.2 s intervals


class Recorder:
    """Keeps (path, headers) of every HTTP request the wrapped app receives."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.seen: list[tuple[str, dict[str, str]]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            self.seen.append((scope["path"], headers))
        await self.app(scope, receive, send)

    def headers_of(self, path: str) -> list[dict[str, str]]:
        return [h for p, h in self.seen if p == path]


@asynccontextmanager
async def keyed_fleet(pool: dict[str, Any]) -> AsyncIterator[tuple[str, Recorder, Any]]:
    """One simulated replica requiring REPLICA_KEY behind a gateway whose pool has `pool`'s
    settings (api_key, forward_headers) and one tenant with TENANT_KEY."""
    async with AsyncExitStack() as stack:
        spec = SimReplicaSpec(
            name="sim-0", port=0, costs=FAST_COSTS, itl_s=0.001, api_key=REPLICA_KEY
        )
        recorder = Recorder(create_sim_app(spec))
        url = await stack.enter_async_context(running_app(recorder))
        pool_config = {"name": "default", "models": [MODEL], "replicas": [url], **pool}
        config = gateway_config(
            [url],
            engine_metrics={"enabled": True, "interval_s": 0.2, "timeout_s": 1.0},
            tenants=[{"name": "acme", "api_key": TENANT_KEY}],
            admin={"api_key": ADMIN_KEY},
            pools=[pool_config],
        )
        app = create_app(config)
        gateway_url = await stack.enter_async_context(running_app(app))
        yield gateway_url, recorder, app.state.gw


until = partial(poll_until, timeout_s=WAIT_S, poll_s=0.05)  # a health check or a scrape


async def test_the_pools_key_goes_on_every_call_and_the_clients_stays_in_the_gateway(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="cachelane")
    pool = {"api_key": REPLICA_KEY, "forward_headers": ["x-user-id"]}
    async with keyed_fleet(pool) as (gateway_url, recorder, gw):
        replica = next(iter(gw.registry.replicas.values()))
        await until(lambda: replica.healthy, "the replica passes its health check")
        await until(lambda: replica.engine is not None, "the engine's metrics are scraped")
        async with AsyncOpenAI(
            base_url=f"{gateway_url}/v1",
            api_key=TENANT_KEY,
            max_retries=0,
            default_headers={"x-user-id": "u-42", "x-secret-thing": "stays"},
        ) as oai:
            whole = await oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=3
            )
            assert whole.choices[0].message.content
            stream = await oai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hello again"}],
                max_tokens=3,
                stream=True,
            )
            chunks = [c async for c in stream]
            assert chunks
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        async with httpx.AsyncClient(base_url=gateway_url, trust_env=False) as http:
            route = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
            pages = [
                await http.post("/debug/route", json=route, headers=admin),
                await http.get("/debug/costs", headers=admin),
                await http.get("/ready"),
                await http.get("/metrics"),
            ]
        for page in pages:  # what the gateway shows of itself never holds the replicas' key
            assert page.status_code == 200, page.text
            assert REPLICA_KEY not in page.text
    bearer = f"Bearer {REPLICA_KEY}"
    for path in ("/v1/models", "/metrics", "/v1/chat/completions"):
        seen = recorder.headers_of(path)
        assert seen, path
        assert all(h.get("authorization") == bearer for h in seen), path
    proxied = recorder.headers_of("/v1/chat/completions")
    assert all(h.get("x-user-id") == "u-42" for h in proxied)  # named in forward_headers
    assert all("x-secret-thing" not in h for h in proxied)  # not named: stays in the gateway
    assert REPLICA_KEY not in caplog.text and TENANT_KEY not in caplog.text


async def test_without_the_key_the_replica_is_unhealthy_and_the_log_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="cachelane")
    async with keyed_fleet({}) as (gateway_url, recorder, gw):
        replica = next(iter(gw.registry.replicas.values()))
        await until(lambda: len(recorder.headers_of("/v1/models")) >= 2, "checked twice")
        assert not replica.healthy
        refused = [
            r.getMessage() for r in caplog.records if "refused the gateway" in r.getMessage()
        ]
        assert len(refused) == 1  # said once, not at every check
        assert "(401)" in refused[0] and "api_key" in refused[0]
        async with httpx.AsyncClient(trust_env=False) as http:
            resp = await http.post(
                f"{gateway_url}/v1/chat/completions",
                headers={"authorization": f"Bearer {TENANT_KEY}"},
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert resp.status_code == 503
            assert resp.json()["error"]["code"]
        # the client's own key never reaches the replica
        assert all("authorization" not in h for _, h in recorder.seen)


async def test_a_wrong_key_is_refused_by_the_simulator_in_openais_envelope() -> None:
    spec = SimReplicaSpec(name="sim-0", port=0, api_key=REPLICA_KEY)
    async with running_app(create_sim_app(spec)) as url, httpx.AsyncClient(trust_env=False) as http:
        assert (await http.get(f"{url}/health")).status_code == 200  # open, as vLLM's
        for headers in ({}, {"authorization": "Bearer wrong"}):
            resp = await http.get(f"{url}/v1/models", headers=headers)
            assert resp.status_code == 401
            assert resp.json()["error"]["code"] == "invalid_api_key"
        ok = await http.get(f"{url}/v1/models", headers={"authorization": f"Bearer {REPLICA_KEY}"})
        assert ok.status_code == 200


async def test_a_warm_carries_the_pools_key() -> None:
    """prewarm: a critical tenant's hot prefix is warmed on the other pinned replica, with the
    pinned pool's key (the simulator refuses a warm without it)."""
    async with AsyncExitStack() as stack:
        recorders, urls = [], []
        for i in range(2):
            spec = SimReplicaSpec(
                name=f"sim-{i}", port=0, costs=FAST_COSTS, itl_s=0.001, api_key=REPLICA_KEY
            )
            recorders.append(Recorder(create_sim_app(spec)))
            urls.append(await stack.enter_async_context(running_app(recorders[-1])))
        pinned = {
            "name": "pinned",
            "models": [MODEL],
            "replicas": urls,
            "pinned": True,
            "hbm_only": True,
            "api_key": REPLICA_KEY,
        }
        config = gateway_config(
            urls,
            tenants=[{"name": "voice", "api_key": TENANT_KEY, "class": "critical"}],
            pools=[pinned],
            prewarm={"enabled": True, "hot_after": 2, "method": "prefetch", "max_per_s": 50},
        )
        app = create_app(config)
        gateway_url = await stack.enter_async_context(running_app(app))
        gw = app.state.gw
        await until(lambda: all(r.healthy for r in gw.registry.replicas.values()), "healthy")
        system = "You are the voice agent of a railway. " * 40
        async with AsyncOpenAI(
            base_url=f"{gateway_url}/v1", api_key=TENANT_KEY, max_retries=0
        ) as oai:
            for question in ("one", "two", "three"):
                await oai.chat.completions.create(
                    model=MODEL,
                    messages=[
                        {"role": "system", "content": system},
                        {"role": "user", "content": question},
                    ],
                    max_tokens=2,
                )

        def warms() -> list[dict[str, str]]:
            return [h for r in recorders for h in r.headers_of("/prefetch")]

        await until(lambda: bool(warms()) and gw.prewarmer.idle, "a warm is sent")
        assert all(h.get("authorization") == f"Bearer {REPLICA_KEY}" for h in warms())
        assert gw.metrics.registry.get_sample_value(
            "cachelane_prewarms_total", {"trigger": "critical", "outcome": "warmed"}
        )
