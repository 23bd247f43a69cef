"""The simulated replica over real HTTP: uvicorn on loopback, driven by the official openai SDK.

Costs are the gateway's defaults (so fetch-vs-recompute decisions are the real ones) and every
sleep is scaled by TIME_FACTOR to keep the suite fast. No assertion depends on timing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from loadtest.sim.config import RemoteTierSpec, SimReplicaSpec
from loadtest.sim.fleet import serve_fleet
from loadtest.sim.remote import create_remote_app
from loadtest.sim.server import create_sim_app
from routing.prompt import approx_tokens, chat_text
from tests.helpers.completions import streamed_chunks
from tests.helpers.ports import free_port
from tests.helpers.servers import running_app

pytestmark = pytest.mark.slow  # `make check` leaves it out: simulated replicas under load

TIME_FACTOR = 0.01  # 4k-token prefill: 1.3 ms; one decode step: 0.1 ms
MODEL = "sim-llama-8b"
BLOCK = 16

SYSTEM = "You are a careful assistant. " + " ".join(f"fact{i} holds." for i in range(1600))


def messages(question: str, system: str = SYSTEM) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def spec(name: str, **overrides: Any) -> SimReplicaSpec:
    return SimReplicaSpec(**{"name": name, "port": 0, "time_factor": TIME_FACTOR, **overrides})


@asynccontextmanager
async def client(base_url: str) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as oai:
        yield oai


def cached(usage: CompletionUsage | None) -> int:
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens is not None
    return usage.prompt_tokens_details.cached_tokens


async def metrics(base_url: str) -> dict[str, float]:
    """Every sample of the replica's /metrics, by sample name (one series per name here)."""
    async with httpx.AsyncClient(trust_env=False) as http:
        text = (await http.get(f"{base_url}/metrics")).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture
async def sim() -> AsyncIterator[str]:
    async with running_app(create_sim_app(spec("sim-0"))) as url:
        yield url


@pytest.fixture
async def remote_pair() -> AsyncIterator[tuple[str, str, str]]:
    """A remote tier and two replicas reading and writing it: (remote, replica a, replica b)."""
    async with AsyncExitStack() as stack:
        remote = RemoteTierSpec(name="remote-0", port=0, capacity_tokens=1_000_000)
        remote_url = await stack.enter_async_context(running_app(create_remote_app(remote)))
        a, b = [
            await stack.enter_async_context(
                running_app(create_sim_app(spec(name, remote_url=remote_url)))
            )
            for name in ("sim-a", "sim-b")
        ]
        yield remote_url, a, b


async def test_chat_non_stream(sim: str) -> None:
    async with client(sim) as oai:
        done = await oai.chat.completions.create(
            model=MODEL, messages=messages("What holds?"), max_tokens=5
        )
    assert done.object == "chat.completion"
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None
    assert done.usage.prompt_tokens == approx_tokens(chat_text(messages("What holds?")))
    assert done.usage.completion_tokens == 5
    assert done.usage.total_tokens == done.usage.prompt_tokens + 5
    assert cached(done.usage) == 0


async def test_chat_stream_with_usage(sim: str) -> None:
    async with client(sim) as oai:
        whole = await oai.chat.completions.create(model=MODEL, messages=messages("a"), max_tokens=4)
        chunks = await streamed_chunks(oai, MODEL, messages("b"), max_tokens=4)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert cached(chunks[-1].usage) > 0  # SYSTEM was cached by `a`


async def test_completions_stream_and_not(sim: str) -> None:
    async with client(sim) as oai:
        whole = await oai.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=3)
        stream = await oai.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=3, stream=True)
        chunks = [chunk async for chunk in stream]
    assert whole.object == "text_completion"
    assert whole.usage is not None and whole.usage.prompt_tokens == approx_tokens(SYSTEM)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_repeated_prefix_is_cached(sim: str) -> None:
    async with client(sim) as oai:
        first = await oai.chat.completions.create(model=MODEL, messages=messages("one?"))
        second = await oai.chat.completions.create(model=MODEL, messages=messages("two?"))
    assert first.usage is not None and second.usage is not None
    assert cached(first.usage) == 0
    hit = cached(second.usage)
    assert 0 < hit < second.usage.prompt_tokens
    assert hit % BLOCK == 0
    assert hit >= approx_tokens(SYSTEM) - 2 * BLOCK  # the whole system prompt, up to its tail
    m = await metrics(sim)
    assert m["vllm:prefix_cache_hits_total"] == hit
    assert m["vllm:prefix_cache_queries_total"] == (
        first.usage.prompt_tokens + second.usage.prompt_tokens
    )


async def test_namespace_header_separates_caches(sim: str) -> None:
    async with client(sim) as oai:
        await oai.chat.completions.create(model=MODEL, messages=messages("q"))
        other = await oai.chat.completions.create(
            model=MODEL,
            messages=messages("q"),
            extra_headers={"x-cachelane-namespace": "tenant-b"},
        )
    assert cached(other.usage) == 0


async def test_hbm_overflow_is_demoted_to_cpu_and_swapped_back() -> None:
    small = spec("sim-cpu", hbm_capacity_tokens=1024, cpu_capacity_tokens=100_000)
    async with running_app(create_sim_app(small)) as url, client(url) as oai:
        first = await oai.chat.completions.create(model=MODEL, messages=messages("x"))
        before = await metrics(url)
        again = await oai.chat.completions.create(model=MODEL, messages=messages("x"))
        after = await metrics(url)
    assert first.usage is not None and again.usage is not None
    assert first.usage.prompt_tokens > 1024
    assert cached(again.usage) > 1024  # HBM alone cannot hold it
    assert before["cachelane_sim_cpu_blocks"] > 0
    assert before["cachelane_sim_swap_in_tokens_total"] == 0
    assert after["cachelane_sim_swap_in_tokens_total"] > 0
    assert after["vllm:kv_cache_usage_perc"] == 1.0
    assert after["vllm:external_prefix_cache_hits_total"] > 0


async def test_remote_tier_written_by_one_replica_is_fetched_by_another(
    remote_pair: tuple[str, str, str],
) -> None:
    _, a, b = remote_pair
    async with client(a) as oai_a, client(b) as oai_b:
        await oai_a.chat.completions.create(model=MODEL, messages=messages("r"))
        fetched = await oai_b.chat.completions.create(model=MODEL, messages=messages("r"))
    assert cached(fetched.usage) > 0
    ma, mb = await metrics(a), await metrics(b)
    assert ma["cachelane_sim_remote_bytes_written_total"] > 0
    assert mb["cachelane_sim_remote_fetch_tokens_total"] == (cached(fetched.usage))
    assert mb["vllm:prefix_cache_hits_total"] == 0  # nothing came from b's own HBM
    assert mb["cachelane_sim_remote_bytes_written_total"] == 0  # a already wrote every block


async def test_remote_write_can_be_declined(remote_pair: tuple[str, str, str]) -> None:
    remote, a, b = remote_pair
    async with client(a) as oai_a, client(b) as oai_b:
        await oai_a.chat.completions.create(
            model=MODEL, messages=messages("w"), extra_headers={"x-cachelane-remote-write": "0"}
        )
        missed = await oai_b.chat.completions.create(model=MODEL, messages=messages("w"))
    ma = await metrics(a)
    assert ma["cachelane_sim_remote_bytes_written_total"] == 0
    assert ma["cachelane_sim_remote_bytes_skipped_total"] > 0
    assert cached(missed.usage) == 0
    async with httpx.AsyncClient(trust_env=False) as http:
        assert (await http.get(f"{remote}/health")).status_code == 200
        assert "cachelane_sim_remote_tier_blocks" in (await http.get(f"{remote}/metrics")).text


async def test_metrics_use_vllm_names_with_model_label(sim: str) -> None:
    async with httpx.AsyncClient(trust_env=False) as http:
        text = (await http.get(f"{sim}/metrics")).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "cachelane_sim_remote_bytes_written_total",
        "cachelane_sim_remote_bytes_skipped_total",
        "cachelane_sim_swap_in_tokens_total",
        "cachelane_sim_remote_fetch_tokens_total",
    ):
        assert f'{name}{{engine="0",model_name="{MODEL}"}}' in text


async def test_load_returns_to_zero_after_concurrent_and_abandoned_requests(sim: str) -> None:
    async with client(sim) as oai:
        await asyncio.gather(
            *(
                oai.chat.completions.create(model=MODEL, messages=messages(f"c{i}"))
                for i in range(8)
            )
        )
        stream = await oai.chat.completions.create(
            model=MODEL, messages=messages("gone"), max_tokens=10_000, stream=True
        )
        async for _ in stream:
            break
        await stream.close()
    for _ in range(200):  # the server notices the disconnect on its next write
        m = await metrics(sim)
        if m["vllm:num_requests_running"] == 0:
            break
        await asyncio.sleep(0.01)
    assert m["vllm:num_requests_running"] == 0
    assert m["vllm:num_requests_waiting"] == 0


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (
            {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
            404,
            "model_not_found",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x" * 600_000}]},
            400,
            "context_length_exceeded",
        ),
        ({"model": MODEL, "messages": []}, 400, "invalid_value"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
            400,
            "invalid_value",
        ),
        ("{not json", 400, "invalid_json"),
    ],
    ids=["unknown-model", "too-long", "no-messages", "zero-max-tokens", "malformed-json"],
)
async def test_errors_use_openai_envelope(sim: str, body: Any, status: int, code: str) -> None:
    content = body if isinstance(body, str) else None
    async with httpx.AsyncClient(trust_env=False) as http:
        response = await http.post(
            f"{sim}/v1/chat/completions",
            content=content,
            json=None if content else body,
            headers={"content-type": "application/json"},
        )
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code
    assert error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


async def test_sdk_raises_typed_errors(sim: str) -> None:
    async with client(sim) as oai:
        with pytest.raises(openai.NotFoundError):
            await oai.chat.completions.create(model="nope", messages=messages("x"))
        with pytest.raises(openai.BadRequestError) as too_long:
            await oai.chat.completions.create(
                model=MODEL, messages=messages("x", system="y" * 600_000)
            )
        assert too_long.value.code == "context_length_exceeded"
        models = await oai.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_router_compatibility_endpoints(sim: str) -> None:
    chat_body = {"model": MODEL, "messages": messages("z"), "max_tokens": 7}
    async with httpx.AsyncClient(base_url=sim, trust_env=False) as http:
        assert (await http.get("/health")).status_code == 200
        load = (await http.get("/get_load")).json()
        server_info = (await http.get("/server_info")).json()
        model_info = (await http.get("/model_info")).json()
        chat_render = (await http.post("/v1/chat/completions/render", json=chat_body)).json()
        completion_render = (
            await http.post("/v1/completions/render", json={"model": MODEL, "prompt": ["ab", "c"]})
        ).json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert "model_path" not in server_info and "model_path" not in model_info
    assert "tokenizer_path" not in server_info and "tokenizer_path" not in model_info
    assert len(chat_render["token_ids"]) == approx_tokens(chat_text(messages("z")))
    assert chat_render["sampling_params"]["max_tokens"] == 7
    assert [len(r["token_ids"]) for r in completion_render] == [1, 1]


async def test_prefetch_then_reset_prefix_cache(sim: str) -> None:
    body = {"model": MODEL, "messages": messages("p")}
    async with httpx.AsyncClient(base_url=sim, trust_env=False) as http:
        cold = (await http.post("/prefetch", json=body)).json()
        warm = (await http.post("/prefetch", json=body)).json()
        assert (await http.post("/reset_prefix_cache")).status_code == 200
        reset = (await http.post("/prefetch", json=body)).json()
    assert cold["cached_tokens_before"] == 0
    assert warm["cached_tokens_before"] == (warm["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert reset["cached_tokens_before"] == 0


async def test_serve_fleet_serves_until_cancelled() -> None:
    remote = RemoteTierSpec(name="remote-0", port=free_port())
    replicas = [spec(f"sim-{i}", port=free_port(), remote_url=remote.url) for i in range(2)]
    started = asyncio.Event()
    fleet = asyncio.create_task(serve_fleet(replicas, remote, started=started))
    try:
        await asyncio.wait_for(started.wait(), timeout=10)
        async with client(replicas[1].url) as oai:
            done = await oai.chat.completions.create(model=MODEL, messages=messages("f"))
        assert done.usage is not None and done.usage.completion_tokens == 16
        async with httpx.AsyncClient(trust_env=False) as http:
            assert (await http.get(f"{remote.url}/health")).status_code == 200
    finally:
        fleet.cancel()
        await asyncio.gather(fleet, return_exceptions=True)
    assert fleet.cancelled()


async def wait_for_load(base_url: str, running: int, waiting: int) -> None:
    """Until one scrape shows exactly this many running and waiting requests (10 s at most)."""
    async with asyncio.timeout(10):
        while True:
            m = await metrics(base_url)
            if (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]) == (
                running,
                waiting,
            ):
                return
            await asyncio.sleep(0.005)


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param({"engine_model": "serial"}, id="serial"),
        # 512-token steps: the blocker's 6,130 tokens take 12 steps, its last leaves 14 tokens
        # to the urgent one; then each ~503-token prompt ends in its own step, in policy order
        pytest.param({"engine_model": "steps", "max_num_batched_tokens": 512}, id="steps"),
    ],
)
async def test_priority_policy_prefills_a_later_urgent_request_first(
    engine: dict[str, Any],
) -> None:
    # Slowed down so the order shows: the blocker's 6k-token prefill holds the replica ~4 s, long
    # enough to queue the others behind it on a loaded machine (at ~1 s the blocker was seen to
    # finish first); each queued 500-token prefill then takes ~340 ms.
    slow = spec("sim-prio", scheduling_policy="priority", time_factor=20.0, **engine)
    order: list[str] = []

    async def complete(http: httpx.AsyncClient, name: str, prompt: str, priority: int) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "priority": priority}
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        order.append(name)

    async with (
        running_app(create_sim_app(slow)) as url,
        httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as http,
    ):
        tasks = [asyncio.create_task(complete(http, "blocker", SYSTEM, 0))]
        await wait_for_load(url, running=1, waiting=0)
        for i in range(3):
            filler = f"queued {i} " + "word " * 400
            tasks.append(asyncio.create_task(complete(http, f"normal-{i}", filler, 0)))
            await wait_for_load(url, running=1, waiting=i + 1)  # arrival order is fixed
        urgent = "urgent " + "word " * 400
        tasks.append(asyncio.create_task(complete(http, "urgent", urgent, -1)))
        await wait_for_load(url, running=1, waiting=4)  # the blocker still holds the slot
        async with asyncio.timeout(20):
            await asyncio.gather(*tasks)
        m = await metrics(url)
    assert order == ["blocker", "urgent", "normal-0", "normal-1", "normal-2"]
    assert m["cachelane_sim_queue_wait_seconds_count"] == 5
    assert m["cachelane_sim_queue_wait_seconds_sum"] > 0


async def test_fcfs_refuses_a_priority_like_vllm(sim: str) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with httpx.AsyncClient(base_url=sim, trust_env=False) as http:
        refused = await http.post("/v1/chat/completions", json={**chat, "priority": 1})
        streamed = await http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "stream": True, "priority": -2},
        )
        default = await http.post("/v1/chat/completions", json={**chat, "priority": 0})
        bad = [
            await http.post("/v1/chat/completions", json={**chat, "priority": value})
            for value in ("high", 1.5, True, None)
        ]
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "Got priority 1 but Priority scheduling is not enabled."
    )
    assert refused.json()["error"]["param"] == "priority"
    assert streamed.status_code == 400
    assert default.status_code == 200
    assert [r.status_code for r in bad] == [400] * 4
    assert {r.json()["error"]["code"] for r in bad} == {"invalid_value"}


def cache_config_info(text: str) -> dict[str, str]:
    [family] = [
        f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info"
    ]
    [sample] = family.samples
    assert sample.value == 1.0
    return sample.labels


async def test_metrics_carry_vllm_cache_config_info(sim: str) -> None:
    tiered = spec("sim-cfg", hbm_capacity_tokens=4096, cpu_capacity_tokens=8000)
    async with (
        running_app(create_sim_app(tiered)) as url,
        httpx.AsyncClient(trust_env=False) as http,
    ):
        default = cache_config_info((await http.get(f"{sim}/metrics")).text)
        with_cpu = cache_config_info((await http.get(f"{url}/metrics")).text)
    assert default["block_size"] == str(BLOCK)
    assert default["num_gpu_blocks"] == str(spec("x").hbm_capacity_tokens // BLOCK)
    assert default["num_cpu_blocks"] == "None"
    assert default["engine"] == "0"
    assert with_cpu["num_gpu_blocks"] == "256"
    assert with_cpu["num_cpu_blocks"] == "500"
    assert with_cpu["kv_cache_size_tokens"] == "4096"
