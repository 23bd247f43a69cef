"""Per-tenant rate limits on real servers: simulated replicas, the gateway
under uvicorn, the official openai client, and real redis-servers for the shared budget."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from gateway.http.app import create_app
from gateway.tenancy.rate_limits import go_duration
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import running_app
from tests.integration.fleet import FAST_COSTS, MODEL, gateway_config

pytestmark = pytest.mark.slow  # `make check` leaves it out: simulated fleets

KEYS = {
    "app": "app-key-ratelimit-0123456789abcdef01234",
    "other": "other-key-ratelimit-0123456789abcdef012",
    "bulk": "bulk-key-ratelimit-0123456789abcdef0123",
}
TENANTS = [
    {"name": "app", "api_key": KEYS["app"]},
    {"name": "other", "api_key": KEYS["other"]},
    {"name": "bulk", "api_key": KEYS["bulk"], "class": "batch"},
]


@asynccontextmanager
async def gateways(
    n: int, rate_limits: dict[str, Any], *, itl_s: float = 0.0005, **extra: Any
) -> AsyncIterator[list[Any]]:
    """`n` gateways (yielded as (url, app) pairs) in front of one simulated replica."""
    async with AsyncExitStack() as stack:
        spec = SimReplicaSpec(name="sim-0", port=0, costs=FAST_COSTS, itl_s=itl_s)
        replica = await stack.enter_async_context(running_app(create_sim_app(spec)))
        out = []
        extra.setdefault("tenants", TENANTS)
        for _ in range(n):
            config = gateway_config([replica], rate_limits=rate_limits, **extra)
            app = create_app(config)
            out.append((await stack.enter_async_context(running_app(app)), app))
        yield out


async def ask(url: str, tenant: str, text: str = "hello", max_tokens: int = 1) -> Any:
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS[tenant], max_retries=0) as c:
        return await c.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens
        )


async def refused(url: str, tenant: str, **kw: Any) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as err:
        await ask(url, tenant, **kw)
    return err.value


def rate_limited(app: Any, tenant: str, limit: str) -> float:
    sample = app.state.gw.metrics.registry.get_sample_value
    return sample("cachelane_rate_limited_total", {"tenant": tenant, "limit": limit}) or 0.0


async def test_requests_per_minute_answer_429_with_retry_after() -> None:
    limits = {"classes": {"standard": {"requests_per_min": 3}}}
    async with gateways(1, limits) as [(url, app)]:
        for _ in range(3):
            assert (await ask(url, "app")).http_response.status_code == 200
        err = await refused(url, "app")
        assert err.status_code == 429
        assert err.response.headers["retry-after"] == "20"  # 60 s / 3
        assert err.body == {  # OpenAI's envelope
            "message": err.body["message"],  # type: ignore[index]
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
        assert (await ask(url, "other")).http_response.status_code == 200  # its own budget
        assert (await ask(url, "bulk")).http_response.status_code == 200  # batch: no limit
        assert rate_limited(app, "app", "requests") == 1


async def test_a_tenant_entry_replaces_its_class_limit() -> None:
    limits = {
        "classes": {"standard": {"requests_per_min": 1}},
        "tenants": {"other": {"requests_per_min": 2}},
    }
    async with gateways(1, limits) as [(url, _)]:
        await ask(url, "app")
        assert (await refused(url, "app")).response.headers["retry-after"] == "60"
        await ask(url, "other")
        await ask(url, "other")
        assert (await refused(url, "other")).response.headers["retry-after"] == "30"


async def test_tokens_per_minute_count_the_answers_usage() -> None:
    """The sim's usage: prompt ~10 tokens, completion max_tokens. Admission charges the prompt's
    estimate; the answer's total_tokens corrects it, so the completions count too."""
    limits = {"tenants": {"app": {"tokens_per_min": 1000}}}
    async with gateways(1, limits) as [(url, app)]:
        first = await ask(url, "app", max_tokens=450)
        usage = first.parse().usage
        assert usage.total_tokens > 450
        await ask(url, "app", max_tokens=450)  # ~910 of 1000 spent (~10 without usage)
        err = await refused(url, "app", text="word " * 160, max_tokens=1)  # ~200 more
        assert err.body["type"] == "tokens"  # type: ignore[index]
        assert 1 <= int(err.response.headers["retry-after"]) <= 60
        assert rate_limited(app, "app", "tokens") == 1


async def test_a_lower_class_keeps_the_tenants_own_limits() -> None:
    """A standard tenant that asks to be served as batch (which has no limit here) is held to
    standard's: a lower class lowers its priority, never its accounting."""
    limits = {"classes": {"standard": {"requests_per_min": 3}}}
    batch = {"x-cachelane-class": "batch"}
    async with gateways(1, limits) as [(url, app)]:
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["app"], max_retries=0) as c:
            chat = c.chat.completions.with_raw_response.create
            messages: Any = [{"role": "user", "content": "hello"}]
            for _ in range(3):
                ok = await chat(model=MODEL, messages=messages, max_tokens=1, extra_headers=batch)
                assert ok.headers["x-cachelane-tenant-class"] == "batch"
            with pytest.raises(openai.RateLimitError):
                await chat(model=MODEL, messages=messages, max_tokens=1, extra_headers=batch)
        assert rate_limited(app, "app", "requests") == 1


async def test_a_stream_closed_early_is_charged_the_output_it_sent() -> None:
    """A client that closes its stream before the usage event is still charged its output:
    the token events the gateway relayed (here 50 of 400 or more, a token each from the
    simulator). 600 tokens a minute refill 10 a second: without the charge the next request
    would see ~590 left."""
    limits = {"tenants": {"app": {"tokens_per_min": 600}}}
    async with gateways(1, limits, itl_s=0.005) as [(url, app)]:
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["app"], max_retries=0) as c:
            messages: Any = [{"role": "user", "content": "hello"}]
            stream = await c.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=400, stream=True
            )
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 50:
                    break
            await stream.close()
        replicas = app.state.gw.registry.replicas.values()
        for _ in range(100):  # the gateway lets go of the stream (and settles it), within ~5 s
            if all(r.in_flight == 0 for r in replicas):
                break
            await asyncio.sleep(0.05)
        remaining = int((await ask(url, "app")).headers["x-ratelimit-remaining-tokens"])
        # two prompts (~5 tokens each) and at least 49 token events leave <= 541, and ~2 s of
        # refill at most since (10 a second)
        assert remaining <= 560, remaining


async def test_two_gateways_share_one_budget_through_redis(own_redis: RedisServer) -> None:
    limits = {"classes": {"standard": {"requests_per_min": 3}}}
    redis = {"backend": "redis", "redis_url": own_redis.url}
    async with gateways(2, limits, index=redis) as [(a, _), (b, app_b)]:
        await ask(a, "app")
        await ask(b, "app")
        await ask(a, "app")
        err = await refused(b, "app")  # the 4th of the minute, on the other gateway
        assert err.response.headers["retry-after"] == "20"
        await refused(a, "app")
        assert (await ask(b, "other")).http_response.status_code == 200
        assert rate_limited(app_b, "app", "requests") == 1


async def test_tokens_are_corrected_in_redis_too(own_redis: RedisServer) -> None:
    limits = {"tenants": {"app": {"tokens_per_min": 1000}}}
    redis = {"backend": "redis", "redis_url": own_redis.url}
    async with gateways(2, limits, index=redis) as [(a, _), (b, _)]:
        await ask(a, "app", max_tokens=450)
        await ask(b, "app", max_tokens=450)
        await refused(a, "app", text="word " * 160, max_tokens=1)


async def test_redis_down_falls_back_to_each_gateways_own_budget(own_redis: RedisServer) -> None:
    """Requests are never failed because Redis is down: each gateway limits by itself."""
    limits = {"classes": {"standard": {"requests_per_min": 2}}}
    redis = {"backend": "redis", "redis_url": own_redis.url}
    async with gateways(1, limits, index=redis) as [(url, app)]:
        await ask(url, "app")
        own_redis.stop()
        await ask(url, "app")  # Redis gone: the local budget (empty so far) decides
        await ask(url, "app")
        await refused(url, "app")
        errors = app.state.gw.metrics.registry.get_sample_value(
            "cachelane_index_errors_total", {"op": "rate_limit"}
        )
        assert errors is not None and errors >= 1


async def test_two_gateways_share_one_budget_on_redis_cluster(redis_cluster_url: str) -> None:
    """The budget is one key, so the script runs on its slot's master (the cluster is the
    session's: the tenant's name is this test's own)."""
    name = f"app-{uuid.uuid4().hex[:8]}"
    tenants = [{"name": name, "api_key": KEYS["app"]}]
    limits = {"tenants": {name: {"requests_per_min": 2}}}
    redis = {"backend": "redis", "redis_url": redis_cluster_url, "redis_cluster": True}
    async with gateways(2, limits, index=redis, tenants=tenants) as [(a, _), (b, app_b)]:
        await ask(a, "app")
        await ask(b, "app")
        assert (await refused(a, "app")).response.headers["retry-after"] == "30"
        assert rate_limited(app_b, name, "requests") == 0


RESET = re.compile(r"\d+ms|(\d+h)?(\d+m)?\d+(\.\d+)?s")  # Go's duration, as OpenAI writes it


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_every_answer_of_a_limited_tenant_carries_openais_rate_limit_headers(
    backend: str, request: pytest.FixtureRequest
) -> None:
    limits = {"tenants": {"app": {"requests_per_min": 3, "tokens_per_min": 1000}}}
    extra: dict[str, Any] = {}
    if backend == "redis":
        own: RedisServer = request.getfixturevalue("own_redis")
        extra["index"] = {"backend": "redis", "redis_url": own.url}
    async with gateways(1, limits, **extra) as [(url, _)]:
        answers = [(await ask(url, "app")).headers for _ in range(3)]
        err = await refused(url, "app")
        unlimited = (await ask(url, "bulk")).headers
    assert [h["x-ratelimit-remaining-requests"] for h in answers] == ["2", "1", "0"]
    for headers in answers:
        assert headers["x-ratelimit-limit-requests"] == "3"
        assert headers["x-ratelimit-limit-tokens"] == "1000"
        assert 0 < int(headers["x-ratelimit-remaining-tokens"]) < 1000
        for kind in ("requests", "tokens"):
            assert RESET.fullmatch(headers[f"x-ratelimit-reset-{kind}"]), headers
    assert answers[0]["x-ratelimit-reset-requests"] == "20s"  # a request's share of the minute
    refusal = err.response.headers
    assert refusal["x-ratelimit-remaining-requests"] == "0"
    assert 40 < seconds_of(refusal["x-ratelimit-reset-requests"]) <= 60  # the minute, spent
    assert not any(name.startswith("x-ratelimit") for name in unlimited)


def seconds_of(reset: str) -> float:
    match = re.fullmatch(r"(?:(\d+)m)?([\d.]+)s", reset)
    assert match is not None, reset
    return 60 * int(match.group(1) or 0) + float(match.group(2))


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0121, "13ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (20, "20s"),
        (360, "6m0s"),
        (3661, "1h1m1s"),
    ],
)
def test_reset_is_written_as_openai_writes_it(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text
