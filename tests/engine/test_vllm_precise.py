"""Precise mode against two real vLLM replicas: the index follows the engines' own KV events,
shared-prefix requests land where the blocks are, and vLLM's cached_tokens agrees."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from gateway.config import parse_config
from gateway.engines.events import precise_namespace
from gateway.engines.tokenizer import PromptTokenizer
from gateway.http.app import create_app
from gateway.serving.planner import engine_salt
from gateway.tenancy.tenants import ANONYMOUS
from loadtest.sim.tiny_tokenizer import BOS, EOS
from routing.hashing import token_block_hashes
from routing.types import Location, Tier
from tests.engine.conftest import BLOCK_SIZE_TOKENS, GPU_BLOCKS, MODEL, VllmReplica
from tests.helpers.servers import running_app
from tests.helpers.waiting import poll_until

pytestmark = pytest.mark.engine

SYSTEM = "You are a meticulous assistant for a logistics company. " * 12  # ~130 tokens
WAIT_S = 20.0  # events reach the gateway in milliseconds; this bounds a stuck test


def chat(user: str, system: str = SYSTEM) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


until = partial(poll_until, timeout_s=WAIT_S, poll_s=0.05)


@asynccontextmanager
async def precise_gateway(replicas: list[VllmReplica], model_dir: Path) -> AsyncIterator[Any]:
    config = parse_config(
        {
            "health": {"interval_s": 0.5, "timeout_s": 2.0, "fail_after": 3},
            "engine_metrics": {"enabled": False},
            "auth": {"mode": "open"},  # no tenants: the test sends no real key
            "routing": {"mode": "precise", "block_size_tokens": BLOCK_SIZE_TOKENS},
            "pools": [
                {
                    "name": "vllm",
                    "models": [MODEL],
                    "replicas": [r.url for r in replicas],
                    "hbm_capacity_tokens": GPU_BLOCKS * BLOCK_SIZE_TOKENS,
                    "kv_events": {
                        "endpoints": {r.url: r.events_endpoint for r in replicas},
                        "replay_endpoints": {r.url: r.replay_endpoint for r in replicas},
                    },
                    "tokenizer": {
                        "path": str(model_dir / "tokenizer.json"),
                        "chat_template": str(model_dir / "chat_template.jinja"),
                        "bos_token": BOS,
                        "eos_token": EOS,
                    },
                }
            ],
        }
    )
    app = create_app(config)
    async with running_app(app) as url:
        assert await app.state.gw.kv_events.wait_connected(10.0)
        app.state.url = url
        yield app


async def test_index_follows_real_vllm_events_and_routes_on_them(
    vllm_replicas: list[VllmReplica], tiny_model: Path
) -> None:
    tok = PromptTokenizer.from_files(
        tiny_model / "tokenizer.json",
        str(tiny_model / "chat_template.jinja"),
        bos_token=BOS,
        eos_token=EOS,
    )
    names = [r.url.removeprefix("http://") for r in vllm_replicas]

    def keys_of(messages: list[ChatCompletionMessageParam]) -> list[int]:
        ids = tok.chat_ids({"messages": messages})
        # the gateway sends the tenant scope's cache_salt (pool cache_salt: true, the default);
        # vLLM folds it into the first block and publishes it, so the keys carry it too
        namespace = precise_namespace(MODEL, engine_salt(ANONYMOUS, None))
        return token_block_hashes(ids, block_size_tokens=BLOCK_SIZE_TOKENS, namespace=namespace)

    async with precise_gateway(vllm_replicas, tiny_model) as app:
        gw = app.state.gw

        def holds(replica: str, keys: list[int]) -> int:
            hits = gw.index.lookup_now(MODEL, keys)
            return sum(1 for h in hits if Location(replica, Tier.HBM) in h)

        async with (
            AsyncOpenAI(base_url=f"{app.state.url}/v1", api_key="x", max_retries=0) as c,
            httpx.AsyncClient(timeout=120, trust_env=False) as h,
        ):
            # 1. Stored: the first request's prompt blocks appear under the gateway's own keys.
            first_messages = chat("Where is order 4821?")
            first = await c.chat.completions.with_raw_response.create(
                model=MODEL, messages=first_messages, max_tokens=2
            )
            x = first.headers["x-cachelane-replica"]
            y = next(n for n in names if n != x)
            usage = first.parse().usage
            assert usage is not None
            assert usage.prompt_tokens == len(tok.chat_ids({"messages": first_messages}))
            full_blocks = usage.prompt_tokens // BLOCK_SIZE_TOKENS
            keys = keys_of(first_messages)
            await until(lambda: holds(x, keys) == full_blocks, "the first prompt's blocks")
            assert gw.index.size(Location(y, Tier.HBM)) == 0

            # 2. A shared prefix lands there, and vLLM's cached_tokens says what the gateway said.
            second = await c.chat.completions.with_raw_response.create(
                model=MODEL, messages=chat("And order 99?"), max_tokens=2
            )
            assert second.headers["x-cachelane-replica"] == x
            assert second.headers["x-cachelane-reason"] == "hbm_hit"
            usage = second.parse().usage
            assert usage is not None
            details = usage.prompt_tokens_details
            assert details is not None and details.cached_tokens is not None
            assert details.cached_tokens >= 3 * BLOCK_SIZE_TOKENS
            assert (
                int(second.headers["x-cachelane-expected-cached-tokens"]) == details.cached_tokens
            )

            # 3. Blocks the other replica prefilled (sent to it directly) draw their prefix there.
            other_system = "Answer the question using only the context given above. " * 12
            direct = {
                "model": MODEL,
                "messages": chat("q", other_system),
                "max_tokens": 1,
                "cache_salt": engine_salt(ANONYMOUS, None),  # as the gateway sends it
            }
            assert (
                await h.post(
                    f"{vllm_replicas[names.index(y)].url}/v1/chat/completions", json=direct
                )
            ).status_code == 200
            other_keys = keys_of(chat("q", other_system))
            await until(lambda: holds(y, other_keys) >= 3, "the other replica's blocks")
            routed = await c.chat.completions.with_raw_response.create(
                model=MODEL, messages=chat("another q", other_system), max_tokens=1
            )
            assert routed.headers["x-cachelane-replica"] == y
            usage = routed.parse().usage
            assert usage is not None
            details = usage.prompt_tokens_details
            assert details is not None and details.cached_tokens
            assert (
                int(routed.headers["x-cachelane-expected-cached-tokens"]) == details.cached_tokens
            )

            # 4. Evicted: fill x's 64 blocks with other prompts; BlockRemoved takes ours out.
            x_url = vllm_replicas[names.index(x)].url
            for topic in range(4):
                filler = f"Topic {topic}: shipments leave the warehouse every morning. " * 40
                body = {"model": MODEL, "prompt": filler, "max_tokens": 1}
                assert (await h.post(f"{x_url}/v1/completions", json=body)).status_code == 200
            await until(lambda: holds(x, keys) == 0, "BlockRemoved to evict the first prompt")
            removed = gw.metrics.registry.get_sample_value(
                "cachelane_kv_events_total", {"replica": x, "type": "BlockRemoved"}
            )
            assert removed and removed > 0
            assert gw.index.size(Location(x, Tier.HBM)) <= GPU_BLOCKS

            # 5. AllBlocksCleared (sent by vLLM with its next engine step) empties x's entries.
            # (Replicas are shared by the session: events of earlier tests may have been replayed.)
            cleared_before = gw.metrics.registry.get_sample_value(
                "cachelane_kv_events_total", {"replica": x, "type": "AllBlocksCleared"}
            )
            assert (await h.post(f"{x_url}/reset_prefix_cache")).status_code == 200
            tiny = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
            assert (await h.post(f"{x_url}/v1/completions", json=tiny)).status_code == 200
            await until(
                lambda: gw.index.size(Location(x, Tier.HBM)) == 0, "AllBlocksCleared on reset"
            )
            cleared = gw.metrics.registry.get_sample_value(
                "cachelane_kv_events_total", {"replica": x, "type": "AllBlocksCleared"}
            )
            assert cleared == (cleared_before or 0) + 1
            assert gw.index.size(Location(y, Tier.HBM)) > 0, "the other replica is untouched"
