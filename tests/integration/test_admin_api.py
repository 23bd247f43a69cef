"""The tenant admin API's verbs, as a client expects them (POST creates, GET reads one, PATCH
changes some fields, PUT replaces, DELETE removes), on a real gateway in front of a simulated
replica, with the tenant store in memory and in a real redis-server; the OpenAPI schema
describes each body; the keys the API answers work with the `openai` client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from tests.helpers.redis_server import RedisServer
from tests.integration.fleet import CLASS_KEYS, MODEL, TEST_AUTH_SECRET, fleet

ADMIN_KEY = "admin-key-12-0123456789abcdef0123456789"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
TENANTS = [{"name": "web", "class": "standard", "api_key": CLASS_KEYS["web"]}]
WAIT_S = 15.0  # bound on any one request


@asynccontextmanager
async def admin_gateway(redis: RedisServer | None) -> AsyncIterator[httpx.AsyncClient]:
    extra: dict[str, Any] = {}
    if redis is not None:
        extra["index"] = {"backend": "redis", "redis_url": redis.url}
    auth = {"mode": "keys", "secret": TEST_AUTH_SECRET}
    async with fleet(1, tenants=TENANTS, admin={"api_key": ADMIN_KEY}, auth=auth, **extra) as f:
        async with httpx.AsyncClient(base_url=f.gateway_url, timeout=WAIT_S) as h:
            yield h


async def answered(h: httpx.AsyncClient, key: str) -> bool:
    async with AsyncOpenAI(
        base_url=f"{str(h.base_url).rstrip('/')}/v1", api_key=key, max_retries=0
    ) as client:
        try:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
        except openai.AuthenticationError:
            return False
    return True


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> Any:
    if request.param == "memory":
        yield None
        return
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


async def test_the_tenant_verbs_a_client_expects(store: RedisServer | None) -> None:
    async with admin_gateway(store) as h:
        # POST without a key: the gateway makes one and answers it, once
        made = await h.post(
            "/admin/tenants", json={"name": "voice", "class": "critical"}, headers=ADMIN
        )
        assert made.status_code == 201, made.text
        voice = made.json()
        assert voice["name"] == "voice" and voice["class"] == "critical"
        key = voice.pop("api_key")
        assert len(key) == 64 and await answered(h, key)
        assert (await h.get("/admin/tenants/voice", headers=ADMIN)).json() == voice
        assert "api_key" not in str((await h.get("/admin/tenants", headers=ADMIN)).json())

        again = await h.post("/admin/tenants", json={"name": "voice"}, headers=ADMIN)
        assert again.status_code == 409 and again.json()["error"]["code"] == "tenant_exists"

        # PATCH changes what it names; the key stays
        patched = await h.patch("/admin/tenants/voice", json={"share_group": "rt"}, headers=ADMIN)
        assert patched.json() == {"name": "voice", "class": "critical", "share_group": "rt"}
        assert await answered(h, key)
        patched = await h.patch("/admin/tenants/voice", json={"class": "batch"}, headers=ADMIN)
        assert patched.json()["class"] == "batch" and patched.json()["share_group"] == "rt"
        bad = await h.patch("/admin/tenants/voice", json={"class": "vip"}, headers=ADMIN)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "class"
        empty = await h.patch("/admin/tenants/voice", json={}, headers=ADMIN)
        assert empty.status_code == 400
        # PATCH with a new key: the old one stops working
        new_key = "voice-key-2-0123456789abcdef0123456789"
        rekeyed = await h.patch("/admin/tenants/voice", json={"api_key": new_key}, headers=ADMIN)
        assert rekeyed.status_code == 200 and rekeyed.json()["class"] == "batch"
        assert await answered(h, new_key) and not await answered(h, key)

        # a file tenant can be changed too; unknown names are 404 on every verb
        web = await h.patch("/admin/tenants/web", json={"class": "critical"}, headers=ADMIN)
        assert web.json()["class"] == "critical" and await answered(h, CLASS_KEYS["web"])
        for method in ("GET", "PATCH", "DELETE"):
            resp = await h.request(
                method, "/admin/tenants/nobody", json={"class": "batch"}, headers=ADMIN
            )
            assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"

        assert (await h.delete("/admin/tenants/voice", headers=ADMIN)).status_code == 204
        assert not await answered(h, new_key)
        unauthorised = await h.post("/admin/tenants", json={"name": "x"})
        assert unauthorised.status_code == 401


async def test_the_admin_api_is_in_the_openapi_schema() -> None:
    async with fleet(
        1, tenants=TENANTS, admin={"api_key": ADMIN_KEY}, exposure={"docs": True}
    ) as f:
        async with httpx.AsyncClient(base_url=f.gateway_url, timeout=WAIT_S) as h:
            schema = (await h.get("/openapi.json")).json()
    tenants, one = schema["paths"]["/admin/tenants"], schema["paths"]["/admin/tenants/{name}"]
    assert set(tenants) == {"get", "post"} and set(one) == {"get", "put", "patch", "delete"}
    posted = tenants["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert posted["required"] == ["name"]
    assert set(posted["properties"]) == {"name", "api_key", "class", "share_group"}
    patched = one["patch"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(patched["properties"]) == {"api_key", "class", "share_group"}
