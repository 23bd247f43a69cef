"""Precise mode: the cost accounting's HBM churn comes from the engines' BlockRemoved events and
equals what the (simulated) engine evicted."""

from __future__ import annotations

import httpx
import pytest
from openai import AsyncOpenAI

from loadtest.sim.tiny_tokenizer import TinyTokenizerFiles, write_tiny_tokenizer
from tests.integration.fleet import MODEL
from tests.integration.test_precise import BS, chat, precise_fleet, until


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> TinyTokenizerFiles:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


async def engine_evicted(url: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{url}/metrics")).text
    line = next(x for x in text.splitlines() if x.startswith("cachelane_sim_hbm_evicted_blocks"))
    return float(line.rsplit(" ", 1)[1])


async def test_hbm_churn_follows_the_engines_evictions(tiny_tokenizer: TinyTokenizerFiles) -> None:
    cap = 24 * BS  # a prompt is ~14 blocks: every new topic pushes older blocks out
    async with precise_fleet(tiny_tokenizer, 1, hbm_capacity_tokens=cap) as f:
        async with AsyncOpenAI(base_url=f"{f.gateway_url}/v1", api_key="unused") as c:
            for topic in ("apples", "rivers", "engines", "deserts", "violins"):
                system = f"Today we discuss {topic} in depth. " * 10
                await c.chat.completions.create(
                    model=MODEL, messages=chat("go", system=system), max_tokens=1
                )
        evicted = await engine_evicted(f.replica_urls[0])
        assert evicted > 0

        def churn() -> float:
            (pool,) = f.gw.costs.snapshot(3600.0)["pools"]
            return float(pool["hbm_evicted_blocks"])

        await until(lambda: churn() == evicted, "the churn to follow the engine's evictions")
        rows = f.gw.costs.snapshot(3600.0)["rows"]
        inserted = sum(r["sums"]["hbm_inserted_blocks"] for r in rows)
        assert inserted >= evicted  # what left HBM was put there by these requests
