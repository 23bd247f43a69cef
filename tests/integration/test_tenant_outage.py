"""Issue 29, item 1, on real servers (gateways via uvicorn, a simulated replica, a redis-server of
the test's own): a tenant revoked in Redis is not served by a gateway that starts while Redis is
paused (SIGSTOP) or stopped; a wrong Redis password stops the gateway at start."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from gateway.http.app import create_app
from gateway.tenancy.store import TenantStoreRefused
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import running_app
from tests.integration.fleet import gateway_config
from tests.integration.test_tenant_security import (
    ADMIN,
    ADMIN_KEY,
    WEB,
    WEB_KEY,
    eventually,
    gateways,
    metric,
    status_of,
)

ACME_KEY = "acme-key-" + "c" * 32
ACME = {"name": "acme", "api_key": ACME_KEY, "class": "standard"}
TENANTS: dict[str, Any] = {"tenants": [WEB, ACME], "admin": {"api_key": ADMIN_KEY}}


@contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    """redis-server stopped by SIGSTOP (it holds its connections but answers nothing)."""
    info = server.cli("INFO", "server").stdout
    pid = int(next(line for line in info.splitlines() if line.startswith("process_id:"))[11:])
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def not_loaded(h: httpx.AsyncClient, url: str) -> None:
    """Every key refused with 503 (never served, never a 401 that a client would take as final);
    /ready and the metrics say why."""
    for key in (ACME_KEY, WEB_KEY):
        r = await h.post(
            f"{url}/v1/chat/completions", json={}, headers={"authorization": f"Bearer {key}"}
        )
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "tenants_not_loaded"
        assert r.headers["retry-after"] == "1"
    ready = await h.get(f"{url}/ready")
    assert ready.status_code == 503
    assert ready.json()["tenants"]["loaded"] is False
    assert ready.json()["tenants"]["failures"] >= 1
    text = (await h.get(f"{url}/metrics")).text
    assert metric(text, "cachelane_tenants_loaded ") == 0
    assert metric(text, "cachelane_tenant_refresh_errors_total{") >= 1


async def test_a_revoked_tenant_stays_revoked_for_a_gateway_started_while_redis_is_paused(
    own_redis: RedisServer,
) -> None:
    async with (
        gateways(1, own_redis.url, **TENANTS) as ([first], _),
        httpx.AsyncClient(timeout=30) as h,
    ):
        assert await status_of(h, first, ACME_KEY) == 200
        assert (await h.delete(f"{first}/admin/tenants/acme", headers=ADMIN)).status_code == 204
        assert await status_of(h, first, ACME_KEY) == 401
        with paused(own_redis):
            async with gateways(1, own_redis.url, **TENANTS) as ([late], _):
                await not_loaded(h, late)
                # the admin key is the config file's, not Redis's: its API still answers
                listed = await h.get(f"{late}/admin/tenants", headers=ADMIN)
                assert listed.status_code == 200
        async with gateways(1, own_redis.url, **TENANTS) as ([late], _):
            assert await status_of(h, late, ACME_KEY) == 401
            assert await status_of(h, late, WEB_KEY) == 200


async def test_keys_are_served_once_a_stopped_redis_answers(own_redis: RedisServer) -> None:
    async with (
        gateways(1, own_redis.url, **TENANTS) as ([first], _),
        httpx.AsyncClient(timeout=30) as h,
    ):
        assert (await h.delete(f"{first}/admin/tenants/acme", headers=ADMIN)).status_code == 204
        own_redis.stop()
        async with gateways(1, own_redis.url, **TENANTS) as ([late], _):
            await not_loaded(h, late)
            own_redis.start()  # empty: the first gateway writes its tombstone back

            async def serves_web() -> bool:
                return await status_of(h, late, WEB_KEY) == 200

            await eventually(serves_web, "the late gateway serves once Redis answers")
            ready = await h.get(f"{late}/ready")
            assert ready.status_code == 200
            assert ready.json()["tenants"] == {"loaded": True, "failures": 0, "last_error": None}

            async def acme_revoked() -> bool:
                return await status_of(h, late, ACME_KEY) == 401

            await eventually(acme_revoked, "the tombstone reaches the late gateway")


async def test_a_wrong_redis_password_is_a_start_up_error(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with RedisServer(password="the-real-password") as server:
        spec = SimReplicaSpec(name="sim-0", port=0, itl_s=0.001)
        async with running_app(create_sim_app(spec)) as replica:
            wrong = server.url.replace("the-real-password", "a-wrong-password")
            config = gateway_config(
                [replica], index={"backend": "redis", "redis_url": wrong}, **TENANTS
            )
            with pytest.raises(RuntimeError, match=r"exited \(3\)"):  # uvicorn: STARTUP_FAILURE
                async with running_app(create_app(config)):
                    pass
    # uvicorn logs the lifespan's error and exits: the message says what to fix
    stderr = capfd.readouterr().err
    assert f"{TenantStoreRefused.__module__}.TenantStoreRefused" in stderr
    assert "Redis refused the gateway's credentials" in stderr
    assert "index.redis_url" in stderr
