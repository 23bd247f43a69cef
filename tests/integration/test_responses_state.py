"""The Responses API's state end to end (gateway/serving/responses.py), with the official openai
client against simulated replicas that keep their responses (loadtest/sim/server.py): a continuation
(`previous_response_id`) reaches the replica that stored its response, GET and DELETE reach it,
another tenant's ids are not there, a replica that is down answers a clear 503 and one that left
the fleet a 410."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

import openai
import pytest
import redis.asyncio as aioredis
import yaml
from openai import AsyncOpenAI
from openai.types.responses import Response

from gateway.config import load_config
from gateway.http.app import create_app
from gateway.serving.responses import created_id
from tests.helpers.redis_server import RedisServer
from tests.helpers.servers import running_app
from tests.integration.fleet import MODEL, fleet
from tests.integration.test_multi_gateway import two_gateways
from tests.integration.test_reload import TENANT_KEY, config_data, name_of, reload, sims

CONTINUATIONS = 6  # with 3 replicas and no pin, six would not all land on one by chance
HEALTH_POLLS = 50  # x 0.1 s: the fleet's health checks run every 0.2 s


def client(url: str, key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


async def both_refused(
    c: AsyncOpenAI, rid: str, error: type[openai.APIStatusError], status: int, code: str
) -> list[openai.APIStatusError]:
    """Retrieving response `rid` and continuing from it each fail with `error`, `status` and
    `code`; returns the two errors."""
    errors = []
    for attempt in (
        c.responses.retrieve(rid),
        c.responses.create(
            model=MODEL, input="more", previous_response_id=rid, max_output_tokens=2
        ),
    ):
        with pytest.raises(error) as err:
            await attempt
        assert err.value.status_code == status
        assert err.value.code == code
        errors.append(err.value)
    return errors


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_continuations_get_and_delete_reach_the_replica_that_stored_it(
    stream: bool,
) -> None:
    async with fleet(3) as f, client(f.gateway_url) as c:
        first: Response
        if stream:
            async with c.responses.stream(model=MODEL, input="hello", max_output_tokens=4) as s:
                first = await s.get_final_response()
        else:
            first = await c.responses.create(model=MODEL, input="hello", max_output_tokens=4)
        owners = set()
        for i in range(CONTINUATIONS):
            raw = await c.responses.with_raw_response.create(
                model=MODEL,
                input=f"and then {i} " * (i + 1),  # different prompts: routing alone would spread
                previous_response_id=first.id,
                max_output_tokens=2,
            )
            owners.add(raw.headers["x-cachelane-replica"])
        assert len(owners) == 1
        fetched = await c.responses.retrieve(first.id)
        assert fetched.id == first.id and fetched.output_text == first.output_text
        await c.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError) as gone:
            await c.responses.retrieve(first.id)
        assert gone.value.code == "response_not_found"


async def test_another_tenants_response_is_not_found() -> None:
    tenants = [
        {"name": "alice", "class": "standard", "api_key": "alice-" + "a" * 32},
        {"name": "bob", "class": "standard", "api_key": "bob-" + "b" * 32},
    ]
    async with (
        fleet(2, tenants=tenants) as f,
        client(f.gateway_url, tenants[0]["api_key"]) as alice,
        client(f.gateway_url, tenants[1]["api_key"]) as bob,
    ):
        mine = await alice.responses.create(model=MODEL, input="secret", max_output_tokens=2)
        assert (await alice.responses.retrieve(mine.id)).id == mine.id
        with pytest.raises(openai.NotFoundError) as err:
            await bob.responses.retrieve(mine.id)
        assert err.value.code == "response_not_found"
        with pytest.raises(openai.NotFoundError) as err:  # nor continued
            await bob.responses.create(
                model=MODEL, input="go on", previous_response_id=mine.id, max_output_tokens=2
            )
        assert err.value.code == "response_not_found"
        assert err.value.param == "previous_response_id"


async def test_a_replica_that_is_down_is_a_503_with_retry_after() -> None:
    async with fleet(2) as f, client(f.gateway_url) as c:
        raw = await c.responses.with_raw_response.create(
            model=MODEL, input="hello", max_output_tokens=2
        )
        owner = raw.headers["x-cachelane-replica"]
        await f.replica_stacks[f.replica_urls.index(f"http://{owner}")].aclose()
        for _ in range(HEALTH_POLLS):
            if not f.gw.registry.replicas[owner].healthy:
                break
            await asyncio.sleep(0.1)
        errors = await both_refused(
            c, raw.parse().id, openai.InternalServerError, 503, "response_replica_unavailable"
        )
        assert [e.response.headers["retry-after"] for e in errors] == ["1", "1"]


async def test_gateways_on_one_redis_share_which_replica_stored_a_response(
    own_redis: RedisServer,
) -> None:
    async with two_gateways(own_redis.url, replicas=3) as (_, gateway_urls, _apps):
        async with client(gateway_urls[0]) as a, client(gateway_urls[1]) as b:
            made = await a.responses.with_raw_response.create(
                model=MODEL, input="hello", max_output_tokens=2
            )
            rid = made.parse().id
            for _ in range(HEALTH_POLLS):  # gateway a writes Redis in the background
                try:
                    fetched = await b.responses.with_raw_response.retrieve(rid)
                    break
                except openai.NotFoundError:
                    await asyncio.sleep(0.1)
            assert fetched.headers["x-cachelane-replica"] == made.headers["x-cachelane-replica"]
            more = await b.responses.with_raw_response.create(
                model=MODEL, input="go on", previous_response_id=rid, max_output_tokens=2
            )
            assert more.headers["x-cachelane-replica"] == made.headers["x-cachelane-replica"]


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b'event: response.created\ndata: {"type":"response.created",', None),
        (b'data: {"type":"response.created","response":{"id":"resp_1"}}\n\n', "resp_1"),
        (b'data: {"type":"response.created","response":{"id":"resp_1"}}\r\n\r\nda', "resp_1"),
        (b'data: {"type":"response.in_progress","response":{"id":"r"}}\n\n', ""),
        (b"data: not json\n\n", ""),
    ],
    ids=["incomplete", "created", "crlf", "other-event", "garbage"],
)
def test_the_id_is_read_from_the_streams_first_event(head: bytes, expected: str | None) -> None:
    assert created_id(head) == expected


async def test_a_replica_that_left_the_fleet_is_a_410(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    async with AsyncExitStack() as stack:
        urls = await sims(stack, 2)
        path.write_text(yaml.safe_dump(config_data(urls)))
        app = create_app(load_config(path), config_path=str(path))
        url = await stack.enter_async_context(running_app(app))
        c = await stack.enter_async_context(client(url, TENANT_KEY))
        made = await c.responses.with_raw_response.create(
            model=MODEL, input="hello", max_output_tokens=2
        )
        owner = made.headers["x-cachelane-replica"]
        path.write_text(yaml.safe_dump(config_data([u for u in urls if name_of(u) != owner])))
        assert (await reload(url)).status_code == 200
        await both_refused(c, made.parse().id, openai.APIStatusError, 410, "response_replica_gone")


async def test_an_id_the_gateway_does_not_know_is_404_for_everyone(own_redis: RedisServer) -> None:
    """Fail closed: after Redis loses the id map, the gateway that never saw the response knows
    nothing of it, and a continuation of it is 404 for its own tenant and for another one alike,
    never sent to a replica whose store may hold it (an engine's store has no tenants)."""
    tenants = [
        {"name": "alice", "class": "standard", "api_key": "alice-" + "a" * 32},
        {"name": "bob", "class": "standard", "api_key": "bob-" + "b" * 32},
    ]
    # one replica: it holds the response, so an id sent on would be continued there
    async with two_gateways(own_redis.url, replicas=1, tenants=tenants) as (_, urls, _apps):
        async with (
            client(urls[0], tenants[0]["api_key"]) as alice,
            client(urls[1], tenants[0]["api_key"]) as alice_elsewhere,
            client(urls[1], tenants[1]["api_key"]) as bob_elsewhere,
        ):
            mine = await alice.responses.create(model=MODEL, input="secret", max_output_tokens=2)
            await asyncio.sleep(0.2)  # the first gateway's write to Redis, in the background
            r = aioredis.from_url(own_redis.url)
            try:
                await r.flushall()
            finally:
                await r.aclose()
            for c in (alice_elsewhere, bob_elsewhere):
                with pytest.raises(openai.NotFoundError) as err:
                    await c.responses.create(
                        model=MODEL,
                        input="go on",
                        previous_response_id=mine.id,
                        max_output_tokens=1,
                    )
                assert err.value.code == "response_not_found"
                assert err.value.param == "previous_response_id"
                with pytest.raises(openai.NotFoundError):
                    await c.responses.retrieve(mine.id)
            # the gateway that stored it still knows it, for its tenant
            more = await alice.responses.create(
                model=MODEL, input="go on", previous_response_id=mine.id, max_output_tokens=2
            )
            assert more.id != mine.id
