"""/metrics on a real gateway in front of simulated replicas: the engines'
observed prompt, cached and output tokens (a stream's too when its client did not ask for them),
TTFT by mode (stream: first byte; whole: response head), the time per output token of streams,
an end-to-end histogram for every request, a bounded `model` label, process metrics, and no
`_created` series."""

from __future__ import annotations

import json
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.fleet import MODEL, fleet

# a long shared prefix, so the second request finds it cached on its replica
PREFIX = "You are a careful assistant. " * 60


def body(user: str, *, stream: bool = False, max_tokens: int = 8) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "system", "content": PREFIX}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


Samples = list[tuple[str, dict[str, str], float]]


async def scrape(h: httpx.AsyncClient) -> tuple[str, Samples]:
    text = (await h.get("/metrics")).text
    samples = [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]
    return text, samples


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(
        v for n, ls, v in samples if n == name and all(ls.get(k) == x for k, x in labels.items())
    )


async def streamed_usage(h: httpx.AsyncClient, payload: dict[str, Any]) -> dict[str, Any]:
    usage: dict[str, Any] = {}
    async with h.stream("POST", "/v1/chat/completions", json=payload) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line.removeprefix("data: ")).get("usage") or usage
    return usage


async def test_prompt_and_cached_tokens_come_from_the_engines_usage() -> None:
    async with fleet(1) as f:
        async with httpx.AsyncClient(base_url=f.gateway_url, timeout=10) as h:
            usages = []
            for i in range(2):
                r = await h.post("/v1/chat/completions", json=body(f"question {i}"))
                assert r.status_code == 200
                usages.append(r.json()["usage"])
            usages.append(await streamed_usage(h, body("question 2", stream=True)))
            _, samples = await scrape(h)
            # a stream without include_usage: the gateway asks the engine on its behalf, counts
            # the usage and strips it from what the client receives
            plain = body("question 3", stream=True)
            del plain["stream_options"]
            assert await streamed_usage(h, plain) == {}
            _, after = await scrape(h)

    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0  # the second and third requests reused the first one's prefix
    (replica,) = [r.removeprefix("http://") for r in f.replica_urls]
    labels = {"replica": replica, "tenant": "anonymous", "model": MODEL}
    assert total(samples, "cachelane_prompt_tokens_total", **labels) == prompt
    assert total(samples, "cachelane_cached_tokens_total", **labels) == cached
    assert total(samples, "cachelane_prompt_tokens_total") == prompt  # no other series
    # the router's own estimate is kept apart
    assert total(samples, "cachelane_estimated_prompt_tokens_total") > 0
    assert total(samples, "cachelane_output_tokens_total", **labels) == 3 * 8  # max_tokens each
    prompt_name, output_name = "cachelane_prompt_tokens_total", "cachelane_output_tokens_total"
    assert total(after, prompt_name) - total(samples, prompt_name) == usages[-1]["prompt_tokens"]
    assert total(after, output_name) - total(samples, output_name) == 8


async def test_ttft_counts_streamed_requests_and_e2e_counts_every_request() -> None:
    itl_s = 0.02
    async with fleet(2, itl_s=itl_s) as f:
        async with httpx.AsyncClient(base_url=f.gateway_url, timeout=10) as h:
            for i in range(2):
                r = await h.post("/v1/chat/completions", json=body(f"whole {i}", max_tokens=4))
                assert r.status_code == 200
            await streamed_usage(h, body("streamed", stream=True, max_tokens=20))
            bad = await h.post("/v1/chat/completions", json={"model": MODEL})  # no messages
            assert bad.status_code == 400
            _, samples = await scrape(h)

    # TTFT: the streamed request at its first byte, the two whole ones at their response head
    ttft = "cachelane_ttft_seconds_count"
    assert total(samples, ttft, model=MODEL, mode="stream") == 1
    assert total(samples, ttft, model=MODEL, mode="whole") == 2
    assert total(samples, "cachelane_tenant_ttft_seconds_count") == 1  # streams only
    # the stream's decode pace: one observation, from its 20 tokens
    assert total(samples, "cachelane_time_per_output_token_seconds_count", model=MODEL) == 1
    assert total(samples, "cachelane_time_per_output_token_seconds_sum") > 0
    assert total(samples, "cachelane_output_tokens_total") == 2 * 4 + 20
    # end to end: all four, the 400 included
    e2e = "cachelane_e2e_seconds"
    assert total(samples, f"{e2e}_count", endpoint="chat", model=MODEL) == 4
    # the stream's end-to-end time runs to its last token (20 tokens ~20 ms apart), not to its
    # first byte: the streamed request alone lasted longer than the TTFT histogram's sum
    assert total(samples, f"{e2e}_sum") >= 19 * itl_s
    stream_ttft_s = total(samples, "cachelane_ttft_seconds_sum", mode="stream")
    assert total(samples, f"{e2e}_sum") > stream_ttft_s + 0.3
    assert total(samples, "cachelane_requests_total", endpoint="chat", model=MODEL) == 4
    assert total(samples, "cachelane_requests_total", model=MODEL, status="400") == 1


async def test_an_unknown_model_adds_no_label_value() -> None:
    async with fleet(1) as f:
        async with httpx.AsyncClient(base_url=f.gateway_url, timeout=10) as h:
            for name in ("no-such-model-1", "no-such-model-2"):
                r = await h.post("/v1/chat/completions", json={**body("x"), "model": name})
                assert r.status_code == 404
            r = await h.post("/v1/chat/completions", json={**body("x"), "model": ["a", "list"]})
            assert r.status_code == 400
            text, samples = await scrape(h)

    assert "no-such-model" not in text
    models = {ls["model"] for _, ls, _ in samples if "model" in ls}
    assert models == {"other"}
    assert total(samples, "cachelane_requests_total", model="other", status="404") == 2
    assert total(samples, "cachelane_e2e_seconds_count", model="other") == 3


async def test_process_metrics_and_no_created_series() -> None:
    async with fleet(1) as f:
        async with httpx.AsyncClient(base_url=f.gateway_url, timeout=10) as h:
            assert (await h.post("/v1/chat/completions", json=body("x"))).status_code == 200
            text, samples = await scrape(h)

    names = {n for n, _, _ in samples}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= names
    assert "python_info" in names
    assert not [line for line in text.splitlines() if "_created" in line]
    assert "cachelane_requests_total" in names  # the counters are still there, without it


async def test_units_in_names_and_no_value_before_it_is_known() -> None:
    async with fleet(1) as f:
        async with httpx.AsyncClient(base_url=f.gateway_url, timeout=10) as h:
            text, samples = await scrape(h)

    (replica,) = [r.removeprefix("http://") for r in f.replica_urls]
    terms = {ls["term"] for n, ls, _ in samples if n == "cachelane_cost_fit_seconds_per_token"}
    assert terms == {"prefill", "swap", "fetch"}
    seconds = [ls for n, ls, _ in samples if n == "cachelane_cost_fit_seconds"]
    assert sorted(seconds, key=lambda ls: ls["term"]) == [
        {"replica": replica, "term": "fixed"},  # seconds per request
        {"replica": replica, "term": "step"},  # seconds per engine step
    ]
    assert "cachelane_cost_fit{" not in text
    # no window of critical requests has passed: the pinned pool's share is not known, not 0
    assert "cachelane_pinned_share" not in text


async def test_an_engines_refusal_counts_as_an_error_by_its_status() -> None:
    """A 400 the engine answers (a prompt over its context length) passes through and is
    counted in cachelane_errors_total as well as cachelane_requests_total."""
    from contextlib import AsyncExitStack

    from gateway.config import parse_config
    from gateway.http.app import create_app
    from loadtest.sim.config import SimReplicaSpec
    from loadtest.sim.server import create_sim_app
    from tests.helpers.servers import running_app
    from tests.integration.fleet import QUICK_CHECKS

    async with AsyncExitStack() as stack:
        spec = SimReplicaSpec(name="short", port=0, itl_s=0.001, max_model_len_tokens=64)
        replica = await stack.enter_async_context(running_app(create_sim_app(spec)))
        config = parse_config(
            {
                **QUICK_CHECKS,
                "auth": {"mode": "open"},
                "pools": [{"name": "p", "models": [MODEL], "replicas": [replica]}],
            }
        )
        url = await stack.enter_async_context(running_app(create_app(config)))
        async with httpx.AsyncClient(base_url=url, timeout=10) as h:
            resp = await h.post("/v1/chat/completions", json=body("too long for the engine"))
            assert resp.status_code == 400
            _, samples = await scrape(h)
    assert total(samples, "cachelane_requests_total", status="400") == 1
    assert total(samples, "cachelane_errors_total", code="replica_400") == 1


async def test_every_fraction_is_named_ratio() -> None:
    from gateway.telemetry.metrics import Metrics

    names = [family.name for family in Metrics().registry.collect()]
    assert "cachelane_pinned_pool_short_ratio" in names
    assert [n for n in names if n.endswith("_share") or n.endswith("_fraction")] == []
