"""A real vLLM started with --api-key behind the gateway: with the pool's api_key the replica is
checked, scraped and served (streamed and whole answers); without it the replica stays unhealthy
and the log says which setting is missing. vLLM checks the key on every path under /v1 (its
AuthenticationMiddleware); /health and /metrics stay open."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from gateway.config import parse_config
from gateway.http.app import create_app
from tests.engine.conftest import MODEL, VllmReplica, start_vllm, stop, wait_ready
from tests.helpers.servers import running_app
from tests.helpers.waiting import poll_until

pytestmark = pytest.mark.engine

REPLICA_KEY = "engine-key-" + "5" * 40
REPLICA_INDEX = 2  # after the session's two replicas (its log name; its core: start_vllm)
WAIT_S = 30.0


@pytest.fixture(scope="module")
def keyed_replica(
    engine_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmReplica]:
    replica = start_vllm(
        engine_python,
        tiny_model,
        REPLICA_INDEX,
        tmp_path_factory.mktemp("vllm-keyed-logs"),
        api_key=REPLICA_KEY,
    )
    try:
        wait_ready(replica, api_key=REPLICA_KEY)
        yield replica
    finally:
        stop(replica)


until = partial(poll_until, timeout_s=WAIT_S, poll_s=0.1)


@asynccontextmanager
async def gateway(replica: VllmReplica, pool: dict[str, Any]) -> AsyncIterator[tuple[str, Any]]:
    config = parse_config(
        {
            "health": {"interval_s": 0.5, "timeout_s": 2.0, "fail_after": 1},
            "engine_metrics": {"enabled": True, "interval_s": 0.5, "timeout_s": 2.0},
            "auth": {"mode": "open"},  # the gateway's own clients: not what this test is about
            "pools": [
                {
                    "name": "vllm",
                    "models": [MODEL],
                    "replicas": [replica.url],
                    "max_prompt_tokens": 512,
                    **pool,
                }
            ],
        }
    )
    app = create_app(config)
    async with running_app(app) as url:
        yield url, app.state.gw


async def test_vllm_refuses_a_call_without_its_key(keyed_replica: VllmReplica) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        assert (await http.get(f"{keyed_replica.url}/v1/models")).status_code == 401
        assert (await http.get(f"{keyed_replica.url}/health")).status_code == 200


async def test_with_the_pools_key_the_gateway_serves_through_vllm(
    keyed_replica: VllmReplica, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="cachelane")
    async with gateway(keyed_replica, {"api_key": REPLICA_KEY}) as (url, gw):
        replica = next(iter(gw.registry.replicas.values()))
        await until(lambda: replica.healthy, "the health check (/v1/models) passes")
        await until(lambda: replica.engine is not None, "vLLM's /metrics is scraped")
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as oai:
            whole = await oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4
            )
            assert whole.usage is not None and whole.usage.completion_tokens > 0
            stream = await oai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hello again"}],
                max_tokens=4,
                stream=True,
            )
            assert [c async for c in stream]
    assert REPLICA_KEY not in caplog.text


async def test_without_the_key_vllm_is_unhealthy_and_the_log_says_why(
    keyed_replica: VllmReplica, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="cachelane")
    async with gateway(keyed_replica, {}) as (url, gw):
        replica = next(iter(gw.registry.replicas.values()))

        def refused() -> bool:
            return any("refused the gateway's credentials (401)" in m for m in caplog.messages)

        await until(refused, "the refusal is logged")
        assert not replica.healthy
        async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
            resp = await http.post(
                f"{url}/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            )
        assert resp.status_code == 503
