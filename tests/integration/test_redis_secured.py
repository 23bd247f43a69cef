"""A secured Redis: gateways reach a real redis-server that requires a
password, logs them in as an ACL user restricted to cachelane's keys, or speaks only TLS with a
certificate made by the test; the URL comes from a secret file (`redis_url_file`) and the record
secret from the environment (`${VAR}`), as the shipped manifests give them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import httpx
import pytest

from gateway.config import load_config
from gateway.http.app import create_app
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import running_app
from tests.integration.fleet import MODEL

pytestmark = pytest.mark.slow  # `make check` leaves it out: TLS and password Redis servers

ADMIN_KEY = "admin-key-" + "a" * 32
NEW_KEY = "new-tenant-key-" + "n" * 32
SECRET = "record-secret-" + "s" * 32
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
WAIT_POLLS, POLL_S = 100, 0.1  # 10 s at most for the other gateway's refresh (every second)
# The ACL a deployment would give the gateways: cachelane's keys only, no admin commands.
GATEWAY_ACL = "~cl:* resetchannels +@all -@admin -@dangerous"

CONFIG = """\
engine_metrics: {enabled: false}
health: {interval_s: 0.2, timeout_s: 0.5, fail_after: 1}
index: {backend: redis, redis_url_file: "${SECRETS}/redis-url"}
auth: {secret: "${RECORD_SECRET}"}
admin: {api_key: "${ADMIN_KEY}"}
pools: [{name: p, models: [sim-llama-8b], replicas: ["${REPLICA}"]}]
"""


@pytest.fixture(params=["requirepass", "acl_user", "tls"])
def secured_redis(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    kind = request.param
    if kind == "requirepass":
        server = RedisServer(password="pass word/with:odd@chars")
    elif kind == "acl_user":
        server = RedisServer(users={"cachelane": ("acl-pass-123", GATEWAY_ACL)})
    else:
        server = RedisServer(tls=True, password="tls-pass-123")
    try:
        server.start()
    except RuntimeError as err:
        if kind == "tls" and "tls" in str(err).lower():
            pytest.skip(f"this redis-server has no TLS support: {err}")
        raise
    try:
        yield server
    finally:
        server.stop()


@asynccontextmanager
async def gateways(redis_url: str, tmp_path: Path, n: int = 2) -> AsyncIterator[list[str]]:
    async with AsyncExitStack() as stack:
        spec = SimReplicaSpec(name="sim-0", port=0, itl_s=0.001)
        replica = await stack.enter_async_context(running_app(create_sim_app(spec)))
        (tmp_path / "redis-url").write_text(redis_url + "\n")
        (tmp_path / "gateway.yaml").write_text(CONFIG)
        env = {
            "SECRETS": str(tmp_path),
            "RECORD_SECRET": SECRET,
            "ADMIN_KEY": ADMIN_KEY,
            "REPLICA": replica,
        }
        config = load_config(tmp_path / "gateway.yaml", env)
        assert config.index.redis_url == redis_url
        urls = [await stack.enter_async_context(running_app(create_app(config))) for _ in range(n)]
        yield urls


async def test_gateways_share_tenants_and_index_through_a_secured_redis(
    secured_redis: RedisServer, tmp_path: Path
) -> None:
    async with gateways(secured_redis.url, tmp_path) as (a, b), httpx.AsyncClient() as h:
        for url in (a, b):
            ready = (await h.get(f"{url}/ready")).json()
            assert ready["index"]["ok"] is True, ready
        put = await h.put(f"{a}/admin/tenants/new", json={"api_key": NEW_KEY}, headers=ADMIN)
        assert put.status_code == 200, put.text
        auth = {"authorization": f"Bearer {NEW_KEY}"}
        status = 0
        for _ in range(WAIT_POLLS):
            status = (await h.post(f"{b}/v1/chat/completions", json=BODY, headers=auth)).status_code
            if status == 200:
                break
            await asyncio.sleep(POLL_S)
        assert status == 200  # the record went through the secured Redis to the other gateway
        for url in (a, b):  # and the index still answers (not degraded by an auth error)
            assert (await h.get(f"{url}/ready")).json()["index"]["ok"] is True
        keys = secured_redis.cli("--scan", "--pattern", "cl:*").stdout.split()
        assert "cl:tenants" in keys


async def test_a_gateway_without_the_password_does_not_start(tmp_path: Path) -> None:
    """A wrong password is a start-up error (gateway/tenancy/store.py TenantStoreRefused), not a
    gateway that serves its file's tenants while ignoring the revocations in Redis."""
    with RedisServer(password="the-real-password") as server:
        wrong = server.url.replace("the-real-password", "a-wrong-password")
        with pytest.raises(RuntimeError, match=r"exited \(3\)"):  # uvicorn: STARTUP_FAILURE
            async with gateways(wrong, tmp_path, n=1):
                pass
        assert server.cli("HLEN", "cl:tenants").stdout.strip() == "0"
