"""The OpenAI surface beyond chat and completions, end to end with the official
openai client: /v1/embeddings (routed by load), /v1/responses (routed by its input like chat,
streamed when asked), /v1/models/{id} and the engines' own /v1/models fields, a client
`cache_salt` in the hash namespace, and 503 + Retry-After while no replica has answered yet."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from gateway.config import parse_config
from gateway.http.app import create_app
from tests.helpers.servers import running_app
from tests.integration.fleet import CACHE_VISIBLE_COSTS, MODEL, fleet

pytestmark = pytest.mark.slow  # `make check` leaves it out: simulated fleets

SYSTEM = "You are a meticulous assistant for a logistics company. " * 40  # ~560 tokens


def client(url: str, retries: int = 0) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=retries)


def names(f: object) -> set[str]:
    return {u.removeprefix("http://") for u in f.replica_urls}  # type: ignore[attr-defined]


async def test_embeddings_go_to_the_least_loaded_replica() -> None:
    async with fleet(2, itl_s=0.05) as f:
        async with client(f.gateway_url) as c:
            # a long stream holds one replica busy
            stream = await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "a long answer"}],
                max_tokens=60,
                stream=True,
            )
            first = await anext(aiter(stream))
            busy = {r.name for r in f.gw.registry.replicas.values() if r.in_flight}
            assert first and len(busy) == 1
            raws = [
                await c.embeddings.with_raw_response.create(model=MODEL, input=["hello", "world"])
                for _ in range(3)
            ]
            await stream.close()
        for raw in raws:
            assert raw.headers["x-cachelane-replica"] in names(f) - busy
            assert raw.headers["x-cachelane-reason"] == "least_loaded"
            result = raw.parse()
            assert [d.index for d in result.data] == [0, 1]
            assert len(result.data[0].embedding) == 16  # decoded from base64 by the SDK
            assert result.data[0].embedding != result.data[1].embedding
            assert result.usage.prompt_tokens > 0
        async with httpx.AsyncClient(base_url=f.gateway_url) as h:
            floats = await h.post(
                "/v1/embeddings",
                json={"model": MODEL, "input": "hello", "encoding_format": "float"},
            )
            bad = await h.post("/v1/embeddings", json={"model": MODEL, "input": 3})
            unknown = await h.post("/v1/embeddings", json={"model": "nope", "input": "x"})
            metrics = (await h.get("/metrics")).text
        assert floats.status_code == 200
        assert isinstance(floats.json()["data"][0]["embedding"][0], float)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
        assert 'endpoint="embeddings"' in metrics


async def test_responses_route_by_input_like_chat_and_stream() -> None:
    async with fleet(3, costs=CACHE_VISIBLE_COSTS) as f:
        async with client(f.gateway_url) as c:
            first = await c.responses.with_raw_response.create(
                model=MODEL, instructions=SYSTEM, input="first question", max_output_tokens=4
            )
            follow = await c.responses.with_raw_response.create(
                model=MODEL,
                instructions=SYSTEM,
                input=[
                    {"role": "user", "content": "first question"},
                    {"role": "assistant", "content": first.parse().output_text},
                    {"role": "user", "content": [{"type": "input_text", "text": "and then?"}]},
                ],
                max_output_tokens=4,
            )
            stream = await c.responses.create(
                model=MODEL, instructions=SYSTEM, input="streamed", max_output_tokens=5, stream=True
            )
            kinds, text, usage = [], "", None
            async for event in stream:
                kinds.append(event.type)
                if event.type == "response.output_text.delta":
                    text += event.delta
                if event.type == "response.completed":
                    usage = event.response.usage
        response = first.parse()
        assert response.object == "response" and response.output_text
        assert response.usage is not None and response.usage.input_tokens > 500
        # the follow-up shares the instructions (~560 tokens): routed where they are cached
        assert follow.headers["x-cachelane-replica"] == first.headers["x-cachelane-replica"]
        assert int(follow.headers["x-cachelane-expected-cached-tokens"]) > 400
        assert follow.parse().usage.input_tokens_details.cached_tokens > 400  # type: ignore[union-attr]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert text and usage is not None and usage.output_tokens == 5
        async with httpx.AsyncClient(base_url=f.gateway_url) as h:
            bad = await h.post("/v1/responses", json={"model": MODEL, "input": 7})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


async def test_models_pass_the_engines_fields_and_retrieve_one() -> None:
    async with fleet(2) as f:
        async with client(f.gateway_url) as c:
            listed = await c.models.list()
            one = await c.models.retrieve(MODEL)
            with pytest.raises(openai.NotFoundError) as err:
                await c.models.retrieve("no-such-model")
        assert [m.id for m in listed.data] == [MODEL]
        card = listed.data[0].model_dump()
        assert card["max_model_len"] > 0 and card["owned_by"] == "cachelane-sim"
        assert card["root"] == MODEL
        assert one.id == MODEL and one.model_dump()["max_model_len"] == card["max_model_len"]
        assert err.value.status_code == 404
        assert err.value.body["code"] == "model_not_found"  # type: ignore[index]


async def test_a_client_cache_salt_is_part_of_the_hash_namespace() -> None:
    async with fleet(3, costs=CACHE_VISIBLE_COSTS) as f:
        async with client(f.gateway_url) as c:

            async def ask(salt: str | None) -> Any:
                extra = {} if salt is None else {"cache_salt": salt}
                raw = await c.chat.completions.with_raw_response.create(
                    model=MODEL,
                    messages=[
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "q"},
                    ],
                    max_tokens=2,
                    extra_body=extra,
                )
                return raw.headers

            await ask("alpha")
            same = await ask("alpha")
            other = await ask("beta")
            unsalted = await ask(None)
            with pytest.raises(openai.BadRequestError) as err:
                await ask("")
        assert int(same["x-cachelane-expected-cached-tokens"]) > 400
        assert other["x-cachelane-expected-cached-tokens"] == "0"
        assert unsalted["x-cachelane-expected-cached-tokens"] == "0"
        assert err.value.body["param"] == "cache_salt"  # type: ignore[index]


def _dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def test_503_with_retry_after_until_a_replica_has_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = parse_config(
        {
            "health": {"interval_s": 0.1, "timeout_s": 0.2, "fail_after": 1},
            "engine_metrics": {"enabled": False},
            "pools": [{"name": "discovered", "replicas": [_dead_url()]}],
            "auth": {"mode": "open"},
        }
    )
    caplog.set_level(logging.WARNING, logger="cachelane.registry")
    async with running_app(create_app(config)) as url:
        await asyncio.sleep(0.5)  # a few failed health checks
        async with client(url) as c:
            with pytest.raises(openai.InternalServerError) as err:
                await c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}]
                )
            with pytest.raises(openai.InternalServerError) as err_retrieve:
                await c.models.retrieve(MODEL)
    assert err.value.status_code == 503
    assert err.value.response.headers["retry-after"] == "1"
    assert err.value.body["code"] == "model_not_ready"  # type: ignore[index]
    assert err_retrieve.value.status_code == 503
    unreachable = [r for r in caplog.records if "cannot be reached" in r.getMessage()]
    assert len(unreachable) == 1  # once, not at every check


async def test_a_model_no_pool_serves_is_404_once_every_replica_answered() -> None:
    health: Any = {"interval_s": 0.1, "timeout_s": 0.2, "fail_after": 1}
    async with fleet(1, health=health) as f:
        # a configured pool model whose replica is down is 503 (known, not served)
        await f.kill_replica(0)
        async with client(f.gateway_url) as c:
            with pytest.raises(openai.NotFoundError):
                await c.chat.completions.create(
                    model="no-such-model", messages=[{"role": "user", "content": "hi"}]
                )
            await asyncio.sleep(0.4)
            with pytest.raises(openai.InternalServerError) as err:
                await c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}]
                )
    assert err.value.status_code == 503 and "retry-after" in err.value.response.headers


async def test_the_sdk_retries_the_503_until_the_replica_answers() -> None:
    """The point of the 503: a client started with the gateway gets its answer, retried."""
    from loadtest.sim.config import SimReplicaSpec
    from loadtest.sim.fleet import bind_socket
    from loadtest.sim.server import create_sim_app

    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    config = parse_config(
        {
            "health": {"interval_s": 0.1, "timeout_s": 0.2, "fail_after": 1},
            "engine_metrics": {"enabled": False},
            "pools": [{"name": "discovered", "replicas": [f"http://127.0.0.1:{port}"]}],
            "auth": {"mode": "open"},
        }
    )
    async with running_app(create_app(config)) as url:

        async def replica_later() -> None:
            await asyncio.sleep(0.3)
            spec = SimReplicaSpec(name="late", port=port)
            async with running_app(create_sim_app(spec), port=port):
                await asyncio.sleep(3)

        late = asyncio.create_task(replica_later())
        async with client(url, retries=3) as c:
            completion = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert completion.choices[0].message.content
        late.cancel()
        await asyncio.gather(late, return_exceptions=True)
