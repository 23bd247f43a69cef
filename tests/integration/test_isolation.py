"""Tenants share no prefix cache by default, in every routing mode: the
gateway sends each tenant scope's own `cache_salt` to engines that take it, so neither its index
nor the engine gives tenant B a hit on tenant A's prompt; and /debug/route, which says how much of
a prompt is cached without running it, answers only the admin key.

The replicas are simulators that tokenize like vLLM and hash their blocks with the request's
`cache_salt` (and ignore the gateway's namespace header), so an engine-side hit across tenants
shows in `usage.prompt_tokens_details.cached_tokens` just as it would with vLLM."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest

from gateway.config import parse_config
from gateway.http.app import create_app
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from loadtest.sim.tiny_tokenizer import BOS, EOS, TinyTokenizerFiles, write_tiny_tokenizer
from tests.helpers.servers import running_app
from tests.integration.fleet import FAST_COSTS, MODEL, TEST_AUTH_SECRET
from tests.integration.test_precise import BS, chat, client, precise_fleet, replica_index, until

pytestmark = pytest.mark.slow  # `make check` leaves it out: simulated fleets

KEY_A = "key-of-a-isolation-0123456789abcdef01234"
KEY_B = "key-of-b-isolation-0123456789abcdef01234"
ADMIN = "admin-key-isolation-0123456789abcdef0123"
TENANTS = [{"name": "a", "api_key": KEY_A}, {"name": "b", "api_key": KEY_B}]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> TinyTokenizerFiles:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@asynccontextmanager
async def engine_like_fleet(files: TinyTokenizerFiles, **extra: Any) -> AsyncIterator[str]:
    """One vLLM-like simulated replica behind a gateway in approximate mode (the default), with
    the pool left at its defaults; yields the gateway's URL."""
    async with AsyncExitStack() as stack:
        spec = SimReplicaSpec(
            name="sim-0",
            port=0,
            costs=FAST_COSTS,
            itl_s=0.001,
            block_size_tokens=BS,
            tokenizer_path=str(files.tokenizer_json),
            chat_template=str(files.chat_template),
            bos_token=BOS,
            eos_token=EOS,
        )
        url = await stack.enter_async_context(running_app(create_sim_app(spec)))
        config = parse_config(
            {
                "health": {"interval_s": 0.2, "timeout_s": 0.5, "fail_after": 1},
                "engine_metrics": {"enabled": False},
                "routing": {"block_size_tokens": BS},
                "auth": {"mode": "keys", "secret": TEST_AUTH_SECRET},
                "tenants": TENANTS,
                "pools": [{"name": "default", "models": [MODEL], "replicas": [url]}],
                **extra,
            }
        )
        yield await stack.enter_async_context(running_app(create_app(config)))


async def cached_tokens(url: str, key: str, user: str) -> tuple[int, int]:
    """(the gateway's expected cached tokens, the engine's cached tokens) of one request."""
    async with client(url, key) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model=MODEL, messages=chat(user), max_tokens=1
        )
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    engine = usage.prompt_tokens_details.cached_tokens or 0
    return int(raw.headers["x-cachelane-expected-cached-tokens"]), engine


async def test_approximate_mode_tenants_share_no_engine_cache(
    tokenizer_files: TinyTokenizerFiles,
) -> None:
    async with engine_like_fleet(tokenizer_files) as url:
        await cached_tokens(url, KEY_A, "q1")
        assert await cached_tokens(url, KEY_B, "q1") == (0, 0)  # same prompt, other tenant
        expected, engine = await cached_tokens(url, KEY_A, "q2")  # same system prompt
        assert engine >= 20 * BS and expected > 0


async def test_precise_mode_tenants_share_no_cache_by_default(
    tokenizer_files: TinyTokenizerFiles,
) -> None:
    async with precise_fleet(tokenizer_files, 2, tenants=TENANTS) as f:
        async with client(f.gateway_url, KEY_A) as a:
            first = await a.chat.completions.with_raw_response.create(
                model=MODEL, messages=chat("q1"), max_tokens=1
            )
        i = replica_index(f, first.headers["x-cachelane-replica"])
        await until(lambda: f.index_size(i) > 0, "tenant a's blocks")
        assert await cached_tokens(f.gateway_url, KEY_B, "q1") == (0, 0)
        expected, engine = await cached_tokens(f.gateway_url, KEY_A, "q2")
        assert expected > 0 and expected == engine


async def test_debug_route_needs_the_admin_key(tokenizer_files: TinyTokenizerFiles) -> None:
    async with engine_like_fleet(tokenizer_files, admin={"api_key": ADMIN}) as url:
        await cached_tokens(url, KEY_A, "q1")
        body = {"model": MODEL, "messages": chat("q2")}
        async with httpx.AsyncClient(base_url=url) as h:
            for headers in ({}, {"authorization": f"Bearer {KEY_A}"}):
                refused = await h.post("/debug/route", json=body, headers=headers)
                assert refused.status_code == 401
                assert refused.json()["error"]["code"] == "invalid_api_key"
            admin = {"authorization": f"Bearer {ADMIN}"}
            as_a = await h.post(
                "/debug/route", json=body, headers=admin | {"x-cachelane-tenant": "a"}
            )
            as_b = await h.post(
                "/debug/route", json=body, headers=admin | {"x-cachelane-tenant": "b"}
            )
            unknown = await h.post(
                "/debug/route", json=body, headers=admin | {"x-cachelane-tenant": "nobody"}
            )
        assert as_a.status_code == 200 and as_a.json()["expected_cached_tokens"] > 0
        assert as_b.json()["tenant"] == "b" and as_b.json()["expected_cached_tokens"] == 0
        assert unknown.status_code == 404


async def test_debug_route_is_off_without_an_admin_key(
    tokenizer_files: TinyTokenizerFiles,
) -> None:
    async with engine_like_fleet(tokenizer_files) as url:
        async with httpx.AsyncClient(base_url=url) as h:
            resp = await h.post(
                "/debug/route",
                json={"model": MODEL, "messages": chat("q")},
                headers={"authorization": f"Bearer {KEY_A}"},
            )
        assert resp.status_code == 404
