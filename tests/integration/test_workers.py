"""`cachelane serve --workers 2` as a real process in front of two simulated replicas: both
workers answer on the one port, a prefix one of them sent is found by the other, and /metrics
counts every worker's requests."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import pytest

from loadtest.sim.config import SIM_MODEL, SimReplicaSpec
from loadtest.sim.server import create_sim_app
from routing.cost import PoolCosts
from tests.helpers.servers import running_app

pytestmark = pytest.mark.slow  # `make check` leaves it out: multi-process gateways

FAST_COSTS = PoolCosts(prefill_tokens_per_s=1e6)
SYSTEM = "You are a careful assistant. " * 60  # ~430 tokens: 26 full blocks
START_BOUND_S = 30.0  # both workers up: a bound for a broken start, not a timing


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def served(replicas: list[str], workers: int) -> AsyncIterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "serve", "--replicas", ",".join(replicas)]
    cmd += ["--port", str(port), "--workers", str(workers), "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
        )
        try:
            await until_workers_see_each_other(url, workers, proc)
            yield url
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, 15)
            await asyncio.wait_for(proc.wait(), timeout=30)


async def until_workers_see_each_other(
    url: str, workers: int, proc: asyncio.subprocess.Process
) -> None:
    """Polls /ready on new connections until every worker has answered that it sees the rest."""
    seen: set[int] = set()
    deadline = time.monotonic() + START_BOUND_S
    while len(seen) < workers:
        assert proc.returncode is None, "cachelane serve exited"
        assert time.monotonic() < deadline, f"workers never all ready: saw {seen}"
        try:
            async with httpx.AsyncClient(timeout=2.0) as h:  # a new connection each time
                status = (await h.get(f"{url}/ready")).json().get("workers", {})
            if status.get("siblings") == workers - 1:
                seen.add(status["pid"])
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.05)


async def chat(url: str, question: str) -> httpx.Response:
    body = {
        "model": SIM_MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 2,
    }
    async with httpx.AsyncClient(timeout=10.0) as h:  # a new connection: any worker may take it
        response = await h.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


async def test_two_workers_share_where_a_prefix_lives_and_their_metrics() -> None:
    async with AsyncExitStack() as stack:
        urls = [
            await stack.enter_async_context(
                running_app(
                    create_sim_app(
                        SimReplicaSpec(name=f"sim-{i}", port=0, costs=FAST_COSTS, itl_s=0.001)
                    )
                )
            )
            for i in range(2)
        ]
        url = await stack.enter_async_context(served(urls, workers=2))
        first = await chat(url, "What is a KV cache?")
        holder = first.headers["x-cachelane-replica"]
        await asyncio.sleep(0.2)  # the record's datagram reaches the sibling
        follow_ups = [await chat(url, f"And question {i}?") for i in range(16)]
        for response in follow_ups:
            # every worker knows the system prompt is there, whichever sent it
            assert int(response.headers["x-cachelane-expected-cached-tokens"]) > 0
            assert response.headers["x-cachelane-replica"] == holder
        async with httpx.AsyncClient(timeout=10.0) as h:
            metrics = (await h.get(f"{url}/metrics")).text
        line = next(
            line
            for line in metrics.splitlines()
            if line.startswith("cachelane_requests_total{") and 'status="200"' in line
        )
        assert float(line.rsplit(" ", 1)[1]) == 17  # both workers' requests, whichever answers
