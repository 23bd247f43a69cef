"""`cachelane serve --workers 2` (a real process): /debug/costs answers for both workers,
whichever serves it, and HBM evictions, which every worker's index sees, are counted once."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loadtest.sim.config import SIM_MODEL, SimReplicaSpec
from loadtest.sim.server import create_sim_app
from tests.helpers.servers import running_app
from tests.integration.test_workers import FAST_COSTS, free_port, until_workers_see_each_other

pytestmark = pytest.mark.slow  # `make check` leaves it out: multi-process gateways

ADMIN_KEY = "costs-workers-admin-" + "0" * 32
HBM_TOKENS = 1_600  # 100 blocks: a handful of ~400-token prompts fill it
REQUESTS = 16
SHARE_WAIT_S = (
    2.5  # the workers write their accounting every second (gateway/accounting/ledger_store.py)
)


@asynccontextmanager
async def served(config: dict[str, Any], tmp: Path) -> AsyncIterator[str]:
    port = free_port()
    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump({**config, "listen": {"host": "127.0.0.1", "port": port}}))
    cmd = [sys.executable, "-m", "gateway", "serve", "--config", str(path), "--workers", "2"]
    url = f"http://127.0.0.1:{port}"
    with (tmp / "gateway.log").open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
        )
        try:
            await until_workers_see_each_other(url, 2, proc)
            yield url
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, 15)
            await asyncio.wait_for(proc.wait(), timeout=30)


async def test_debug_costs_merges_the_workers_and_counts_evictions_once(tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        spec = SimReplicaSpec(
            name="sim-0", port=0, costs=FAST_COSTS, itl_s=0.001, hbm_capacity_tokens=HBM_TOKENS
        )
        replica = await stack.enter_async_context(running_app(create_sim_app(spec)))
        config = {
            "admin": {"api_key": ADMIN_KEY},
            "tenants": [{"name": "web", "api_key": "costs-workers-web-" + "0" * 32}],
            "engine_metrics": {"enabled": False},
            "pools": [
                {
                    "name": "p",
                    "models": [SIM_MODEL],
                    "replicas": [replica],
                    "hbm_capacity_tokens": HBM_TOKENS,
                    "costs": {"prefill_tokens_per_s": FAST_COSTS.prefill_tokens_per_s},
                }
            ],
        }
        url = await stack.enter_async_context(served(config, tmp_path))
        headers = {"authorization": "Bearer costs-workers-web-" + "0" * 32}
        for i in range(REQUESTS):  # unique prompts, each on a new connection: both workers
            body = {
                "model": SIM_MODEL,
                "messages": [{"role": "user", "content": f"topic {i}: " + "lorem ipsum " * 130}],
                "max_tokens": 2,
                "stream": True,
            }
            async with httpx.AsyncClient(timeout=10.0) as h:
                resp = await h.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            assert resp.status_code == 200, resp.text
        await asyncio.sleep(SHARE_WAIT_S)
        async with httpx.AsyncClient(timeout=10.0) as h:
            sim = (await h.get(f"{replica}/metrics")).text
        evicted = next(
            float(x.rsplit(" ", 1)[1])
            for x in sim.splitlines()
            if x.startswith("cachelane_sim_hbm_evicted_blocks")
        )
        assert evicted > 0
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        for _ in range(4):  # new connections: whichever worker answers, the same account
            async with httpx.AsyncClient(timeout=10.0) as h:
                window = (await h.get(f"{url}/debug/costs", headers=admin)).json()["windows"][2]
            assert window["processes"] == 2
            (row,) = window["rows"]
            assert row["sums"]["requests"] == REQUESTS
            assert row["sums"]["timed_requests"] == REQUESTS
            (pool,) = window["pools"]
            assert pool["hbm_evicted_blocks"] == evicted
        async with httpx.AsyncClient(timeout=10.0) as h:
            metrics = (await h.get(f"{url}/metrics")).text
        counted = sum(
            float(x.rsplit(" ", 1)[1])
            for x in metrics.splitlines()
            if x.startswith("cachelane_cost_hbm_blocks_total{") and 'kind="evicted"' in x
        )
        assert counted == evicted  # once, though both workers' indexes saw every eviction
