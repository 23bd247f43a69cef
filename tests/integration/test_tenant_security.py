"""Tenant security on real servers (gateways via uvicorn, simulated replicas, a redis-server
of the test's own): authentication fails closed, admin tenants survive a Redis
restart, a write to Redis cannot add or take over a tenant, and the admin API's misuses get 4xx
(409 for a key in use) or 503 while Redis is down, never 500."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.http.app import create_app
from gateway.tenancy.keys import Keyring
from gateway.tenancy.records import Record, dump, load
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from routing.types import TenantClass
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import running_app
from tests.integration.fleet import MODEL, TEST_AUTH_SECRET, Fleet, fleet, gateway_config

pytestmark = pytest.mark.slow  # `make check` leaves it out: several gateways and fleets

ADMIN_KEY = "admin-key-" + "a" * 32
WEB_KEY = "web-key-" + "w" * 32
LATE_KEY = "late-key-" + "l" * 32
EVIL_KEY = "evil-key-" + "e" * 32
WEB = {"name": "web", "api_key": WEB_KEY, "class": "standard"}
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
TENANTS_KEY = "cl:tenants"
WAIT_S = 10.0  # bound on every wait for a refresh (they run every second)
POLL_S = 0.1


def bearer(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


async def status_of(h: httpx.AsyncClient, url: str, key: str | None) -> int:
    r = await h.post(f"{url}/v1/chat/completions", json=BODY, headers=bearer(key))
    if r.status_code >= 400:
        assert set(r.json()["error"]) >= {"message", "type", "code"}  # the OpenAI envelope
    return r.status_code


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    for _ in range(int(WAIT_S / POLL_S)):
        if await check():
            return
        await asyncio.sleep(POLL_S)
    assert await check(), what


def as_text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else value or ""


def metric(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@asynccontextmanager
async def gateways(
    n: int, redis_url: str | None, **overrides: Any
) -> AsyncIterator[tuple[list[str], list[Any]]]:
    """One simulated replica and `n` gateways with the same config (on one Redis if given)."""
    async with AsyncExitStack() as stack:
        spec = SimReplicaSpec(name="sim-0", port=0, itl_s=0.001)
        replica = await stack.enter_async_context(running_app(create_sim_app(spec)))
        if redis_url is not None:
            overrides["index"] = {"backend": "redis", "redis_url": redis_url}
        apps = [create_app(gateway_config([replica], **overrides)) for _ in range(n)]
        urls = [await stack.enter_async_context(running_app(app)) for app in apps]
        yield urls, apps


# ---- authentication fails closed -------------------------------------------------------


@asynccontextmanager
async def web_fleet_with_admin() -> AsyncIterator[tuple[Fleet, httpx.AsyncClient]]:
    """One replica behind a gateway with the tenant web and an admin key, and a client."""
    async with (
        fleet(1, tenants=[WEB], admin={"api_key": ADMIN_KEY}) as f,
        httpx.AsyncClient(timeout=30) as h,
    ):
        yield f, h


async def test_deleting_the_last_tenant_refuses_every_request() -> None:
    async with web_fleet_with_admin() as (f, h):
        url = f.gateway_url
        assert await status_of(h, url, WEB_KEY) == 200
        assert await status_of(h, url, None) == 401
        deleted = await h.delete(f"{url}/admin/tenants/web", headers=ADMIN)
        assert deleted.status_code == 204
        assert (await h.get(f"{url}/admin/tenants", headers=ADMIN)).json()["data"] == []
        assert await status_of(h, url, None) == 401
        assert await status_of(h, url, WEB_KEY) == 401
        assert await status_of(h, url, "any-key-at-all") == 401
        text = (await h.get(f"{url}/metrics")).text
        assert metric(text, 'cachelane_errors_total{code="invalid_api_key"}') == 4


async def test_keys_are_required_unless_the_config_says_open() -> None:
    async with httpx.AsyncClient(timeout=30) as h:
        async with fleet(1, auth={"mode": "keys"}) as f:  # no tenant at all: nobody gets in
            assert await status_of(h, f.gateway_url, None) == 401
            assert await status_of(h, f.gateway_url, "whatever") == 401
        async with fleet(1, auth={"mode": "open"}) as f:
            assert await status_of(h, f.gateway_url, None) == 200


@pytest.mark.parametrize("lose", ["restart", "delete_hash"])
async def test_admin_tenants_survive_losing_the_hash_and_keys_stay_required(
    own_redis: RedisServer, lose: str
) -> None:
    """Findings 1 and 2: a Redis restarted without persistence, or the hash deleted, neither
    opens the gateways nor forgets the tenants the admin API added; the hash is written back."""
    async with (
        gateways(2, own_redis.url, admin={"api_key": ADMIN_KEY}) as (urls, _apps),
        httpx.AsyncClient(timeout=30) as h,
    ):
        put = await h.put(
            f"{urls[0]}/admin/tenants/late", json={"api_key": LATE_KEY}, headers=ADMIN
        )
        assert put.status_code == 200, put.text

        async def both_serve_late() -> bool:
            return [await status_of(h, u, LATE_KEY) for u in urls] == [200, 200]

        await eventually(both_serve_late, "the second gateway learns of the tenant")
        raw = aioredis.Redis.from_url(own_redis.url)
        try:
            if lose == "restart":
                await asyncio.to_thread(own_redis.restart)
            else:
                await raw.delete(TENANTS_KEY)

            async def written_back() -> bool:
                return bool(await raw.hexists(TENANTS_KEY, "late"))

            await eventually(written_back, "a gateway writes the tenant back")
            await asyncio.sleep(1.5)  # more refreshes on both gateways
            for url in urls:
                assert await status_of(h, url, None) == 401
                assert await status_of(h, url, "not-a-key") == 401
                assert await status_of(h, url, LATE_KEY) == 200
        finally:
            await raw.aclose()


# ---- Redis is not a way in ------------------------------------------------------------


async def test_records_written_to_redis_without_the_secret_are_ignored(
    own_redis: RedisServer,
) -> None:
    async with (
        gateways(2, own_redis.url, tenants=[WEB], admin={"api_key": ADMIN_KEY}) as (urls, _apps),
        httpx.AsyncClient(timeout=30) as h,
    ):
        put = await h.put(
            f"{urls[0]}/admin/tenants/late", json={"api_key": LATE_KEY}, headers=ADMIN
        )
        assert put.status_code == 200
        raw = aioredis.Redis.from_url(own_redis.url)
        try:
            stored = as_text(await raw.hget(TENANTS_KEY, "late"))
            bare = hashlib.sha256(LATE_KEY.encode()).hexdigest()
            assert stored and bare not in stored  # no unsalted digest to guess keys against
            evil_digest = hashlib.sha256(EVIL_KEY.encode()).hexdigest()
            wrong = Keyring("not-the-gateways-secret-" + "x" * 16)
            forged = Record("late", wrong.digest(EVIL_KEY), TenantClass.CRITICAL, None, 9e9)
            await raw.hset(
                TENANTS_KEY,
                mapping={
                    # the pre-signing format: a critical tenant with a key of the writer's choice
                    "evil": json.dumps({"digest": evil_digest, "class": "critical"}),
                    # a take-over of an admin tenant, signed with another secret
                    "late": dump(forged, wrong),
                    # a file tenant's name, unsigned
                    "web": json.dumps(
                        {"v": 1, "digest": evil_digest, "class": "critical", "at": 9e9}
                    ),
                    "junk-text": "not json",
                    "junk-list": "[1, 2]",
                    "junk-types": json.dumps({"v": 1, "digest": 5, "at": "x", "sig": "00"}),
                    "junk-bytes": b"\xff\xfe\x00",
                },
            )

            async def healed() -> bool:
                value = await raw.hget(TENANTS_KEY, "late")
                keyring = Keyring(TEST_AUTH_SECRET)
                try:
                    return load("late", as_text(value), keyring).digest == (
                        keyring.digest(LATE_KEY)
                    )
                except ValueError:
                    return False

            await eventually(healed, "the gateways write the genuine record back")
            # an admin change still reaches the other gateway: the refresh did not stop
            put = await h.put(
                f"{urls[0]}/admin/tenants/after",
                json={"api_key": "after-" + "z" * 32},
                headers=ADMIN,
            )
            assert put.status_code == 200

            async def second_sees_it() -> bool:
                return await status_of(h, urls[1], "after-" + "z" * 32) == 200

            await eventually(second_sees_it, "the second gateway still refreshes its tenants")
            for url in urls:
                assert await status_of(h, url, EVIL_KEY) == 401
                assert await status_of(h, url, LATE_KEY) == 200
                assert await status_of(h, url, WEB_KEY) == 200
                listed = await h.get(f"{url}/admin/tenants", headers=ADMIN)
                names = {t["name"]: t["class"] for t in listed.json()["data"]}
                assert names == {"web": "standard", "late": "standard", "after": "standard"}
            texts = [(await h.get(f"{url}/metrics")).text for url in urls]
            rejected = "cachelane_tenant_records_rejected_total"
            for text in texts:  # every gateway saw the records that stayed
                assert metric(text, f'{rejected}{{reason="unsigned"}}') == 1
                assert metric(text, f'{rejected}{{reason="malformed"}}') == 5
            # the forged take-over: seen by one gateway at least before it was healed
            assert sum(metric(t, f'{rejected}{{reason="bad_signature"}}') for t in texts) >= 1
        finally:
            await raw.aclose()


async def test_short_keys_are_refused_by_the_admin_api() -> None:
    async with web_fleet_with_admin() as (f, h):
        short = await h.put(
            f"{f.gateway_url}/admin/tenants/weak",
            json={"api_key": "only-20-characters!!"},
            headers=ADMIN,
        )
        assert short.status_code == 400
        assert "32 characters" in short.json()["error"]["message"]
        assert "only-20-characters" not in short.text  # the key is never echoed


# ---- the admin API ----------------------------------------------------------------------


async def test_a_key_of_another_tenant_or_the_admin_gets_409() -> None:
    async with web_fleet_with_admin() as (f, h):
        url = f.gateway_url
        for key in (WEB_KEY, ADMIN_KEY):
            taken = await h.put(f"{url}/admin/tenants/thief", json={"api_key": key}, headers=ADMIN)
            assert taken.status_code == 409
            assert taken.json()["error"]["code"] == "key_in_use"
        again = await h.put(
            f"{url}/admin/tenants/web", json={"api_key": WEB_KEY, "class": "batch"}, headers=ADMIN
        )
        assert again.status_code == 200  # a tenant may be replaced with its own key
        names = [
            t["name"] for t in (await h.get(f"{url}/admin/tenants", headers=ADMIN)).json()["data"]
        ]
        assert names == ["web"]


async def test_a_delete_applies_to_every_gateway_file_tenants_included(
    own_redis: RedisServer,
) -> None:
    overrides = {"tenants": [WEB], "admin": {"api_key": ADMIN_KEY}}
    async with (
        gateways(2, own_redis.url, **overrides) as (urls, _apps),
        httpx.AsyncClient(timeout=30) as h,
    ):
        assert [await status_of(h, u, WEB_KEY) for u in urls] == [200, 200]
        assert (await h.delete(f"{urls[0]}/admin/tenants/web", headers=ADMIN)).status_code == 204

        async def gone_everywhere() -> bool:
            return [await status_of(h, u, WEB_KEY) for u in urls] == [401, 401]

        await eventually(gone_everywhere, "the delete reaches the second gateway")
        # a gateway started afterwards, with the same file, honours the delete from the start
        async with gateways(1, own_redis.url, **overrides) as (late_urls, _):
            assert await status_of(h, late_urls[0], WEB_KEY) == 401
        # and the tenant can be given back through the admin API
        put = await h.put(f"{urls[1]}/admin/tenants/web", json={"api_key": WEB_KEY}, headers=ADMIN)
        assert put.status_code == 200

        async def back_everywhere() -> bool:
            return [await status_of(h, u, WEB_KEY) for u in urls] == [200, 200]

        await eventually(back_everywhere, "the new record reaches both gateways")


@pytest.mark.parametrize(
    "body",
    [
        b"[]",
        b'[{"api_key": "x"}]',
        b'"a string"',
        b"not json",
        b"{" * 300 + b"}" * 300,
        json.dumps({"api_key": 12345}).encode(),
        json.dumps({"api_key": "k" * 40, "class": 5}).encode(),
        json.dumps({"api_key": "k" * 40, "class": "royalty"}).encode(),
        json.dumps({"api_key": "k" * 40, "share_group": ["a"]}).encode(),
        json.dumps({"api_key": "k" * 40, "admin": True}).encode(),
        json.dumps({"class": "standard"}).encode(),
        json.dumps({"api_key_sha256": "0" * 64}).encode(),
    ],
    ids=[
        "empty-list",
        "list",
        "string",
        "not-json",
        "deep",
        "key-not-string",
        "class-not-string",
        "unknown-class",
        "group-not-string",
        "unknown-field",
        "no-key",
        "sha256-only",
    ],
)
async def test_bad_admin_bodies_get_400(body: bytes) -> None:
    async with web_fleet_with_admin() as (f, h):
        r = await h.put(f"{f.gateway_url}/admin/tenants/new", content=body, headers=ADMIN)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        text = (await h.get(f"{f.gateway_url}/metrics")).text
        assert 'cachelane_errors_total{code="internal_error"}' not in text


async def test_admin_changes_answer_503_while_redis_is_down(own_redis: RedisServer) -> None:
    async with (
        gateways(1, own_redis.url, tenants=[WEB], admin={"api_key": ADMIN_KEY}) as (urls, _),
        httpx.AsyncClient(timeout=30) as h,
    ):
        url = urls[0]
        own_redis.stop()
        put = await h.put(f"{url}/admin/tenants/late", json={"api_key": LATE_KEY}, headers=ADMIN)
        delete = await h.delete(f"{url}/admin/tenants/web", headers=ADMIN)
        for r in (put, delete):
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "store_unavailable"
        # nothing changed: the file's tenant is still served, the new one is not
        assert await status_of(h, url, WEB_KEY) == 200
        assert await status_of(h, url, LATE_KEY) == 401
        assert (await h.get(f"{url}/admin/tenants", headers=ADMIN)).status_code == 200


# ---- tenant names are a safe identifier ----------------------------------------------------------

LOOK_KEY = "lookalike-key-" + "k" * 32


@pytest.mark.parametrize(
    "name",
    ["ev%00il", "ev%0Ail", "we%E2%80%AEb", "w%E2%80%8Beb", "x" * 5000, ".web", "a%20b"],
    ids=["nul", "newline", "rlo", "zwsp", "5000", "dot-first", "space"],
)
async def test_the_admin_api_refuses_unsafe_tenant_names(name: str) -> None:
    async with web_fleet_with_admin() as (f, h):
        url = f"{f.gateway_url}/admin/tenants/{name}"
        r = await h.put(url, json={"api_key": LOOK_KEY}, headers=ADMIN)
        assert r.status_code in (400, 404), r.text  # 404: the router's, for a path too long
        if r.status_code == 400:
            error = r.json()["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", "name"), error
        listed = (await h.get(f"{f.gateway_url}/admin/tenants", headers=ADMIN)).json()["data"]
        assert [t["name"] for t in listed] == ["web"]
        assert "\x00" not in (await h.get(f"{f.gateway_url}/metrics")).text


@pytest.mark.parametrize(
    "name",
    [
        "WEB",
        "Web",
        "%EF%BD%97%EF%BD%85%EF%BD%82",  # full-width
        "%D0%B0cme",  # Cyrillic a
        "web%CD%8F",  # + U+034F
        "web%EF%B8%8F",  # + U+FE0F
        "web%E1%A0%8B",  # + U+180B
        "web%E3%85%A4",  # + U+3164
        "%E1%85%9Fweb",  # U+115F first
        "w%CC%B6eb",  # a combining overlay
        "%E3%85%A4",  # invisible alone
    ],
    ids=str,
)
async def test_the_admin_api_refuses_a_lookalike_of_a_live_tenant(name: str) -> None:
    async with web_fleet_with_admin() as (f, h):
        url = f"{f.gateway_url}/admin/tenants/{name}"
        r = await h.put(url, json={"api_key": LOOK_KEY}, headers=ADMIN)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "name"
        listed = (await h.get(f"{f.gateway_url}/admin/tenants", headers=ADMIN)).json()["data"]
        assert [t["name"] for t in listed] == ["web"]


@pytest.mark.parametrize("group", ["a\nb", "a\x00b", "g" * 5000, "T\u0435am"], ids=str)
async def test_the_admin_api_refuses_an_unsafe_share_group(group: str) -> None:
    """One rule for names and share groups, in the admin API as in config files."""
    async with web_fleet_with_admin() as (f, h):
        url = f"{f.gateway_url}/admin/tenants/late"
        body = {"api_key": LOOK_KEY, "share_group": group}
        r = await h.put(url, json=body, headers=ADMIN)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "share_group"
        ok = await h.put(url, json=body | {"share_group": "team-a"}, headers=ADMIN)
        assert ok.status_code == 200, ok.text
        assert ok.json()["share_group"] == "team-a"
        r = await h.put(url, json={"api_key": LOOK_KEY}, headers=ADMIN)
        assert r.status_code == 200, r.text
