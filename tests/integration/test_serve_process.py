"""`cachelane serve` as a real process: the start-up line says how it is set up (open auth
included), and with `--workers 2` SIGHUP reloads the config in each worker without replacing the
processes (whose embedded index would go with them). Simulated replicas on loopback."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import IO

import httpx
import pytest

from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from tests.helpers.ports import free_port
from tests.helpers.servers import running_app, until_serve_ready

pytestmark = pytest.mark.slow  # `make check` leaves it out: gateway processes

START_BOUND_S = 30.0  # a Python start-up (two with workers) on a loaded 2-core machine
RELOAD_BOUND_S = 15.0


@asynccontextmanager
async def serve(*args: str) -> AsyncIterator[tuple[str, asyncio.subprocess.Process, IO[bytes]]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "gateway", "serve", "--port", str(port), *args]
    with tempfile.TemporaryFile() as log:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
        )
        try:
            await until_serve_ready(url, proc, START_BOUND_S)
            yield url, proc, log
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), timeout=30)


def text_of(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read().decode()


async def sim(stack: AsyncExitStack, name: str) -> str:
    spec = SimReplicaSpec(name=name, port=0, itl_s=0.001)
    return await stack.enter_async_context(running_app(create_sim_app(spec)))


async def test_the_start_up_line_says_auth_is_open_on_a_quick_start() -> None:
    async with AsyncExitStack() as stack:
        replica = await sim(stack, "sim-0")
        async with serve("--replicas", replica) as (url, _, log):
            for _ in range(int(START_BOUND_S / 0.1)):  # the line is logged as it starts serving
                if "serving on" in text_of(log):
                    break
                await asyncio.sleep(0.1)
            text = text_of(log)
    assert f"serving on {url}: auth open (no key checked); pools: default 1/1 healthy" in text
    assert "auth.mode is open: every request is served, without a key" in text


async def worker_views(url: str, bound_s: float, want_replicas: int) -> dict[int, int]:
    """Each worker's pid -> the replicas its /ready lists, polled on new connections until both
    workers have answered with `want_replicas`."""
    seen: dict[int, int] = {}
    deadline = time.monotonic() + bound_s
    while sum(n == want_replicas for n in seen.values()) < 2:
        assert time.monotonic() < deadline, f"workers never all saw {want_replicas}: {seen}"
        try:
            async with httpx.AsyncClient(timeout=2.0) as h:
                ready = (await h.get(f"{url}/ready")).json()
            seen[ready["workers"]["pid"]] = len(ready["replicas"])
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.05)
    return seen


ADMIN_KEY = "admin-key-12-0123456789abcdef0123456789"


@pytest.mark.parametrize("how", ["sighup", "admin"])
async def test_a_reload_reaches_every_worker_in_place(tmp_path: Path, how: str) -> None:
    """SIGHUP to the supervisor, or POST /admin/reload to whichever worker answers: every
    worker reloads the file, and the processes (with their embedded index) stay."""
    async with AsyncExitStack() as stack:
        first, second = await sim(stack, "sim-0"), await sim(stack, "sim-1")
        path = tmp_path / "gateway.yaml"

        def write(replicas: list[str]) -> None:
            path.write_text(
                f"admin: {{api_key: {ADMIN_KEY}}}\n"
                f"pools: [{{name: p, replicas: [{', '.join(repr(r) for r in replicas)}]}}]\n"
            )

        write([first])
        async with serve("--config", str(path), "--workers", "2") as (url, proc, log):
            before = await worker_views(url, START_BOUND_S, want_replicas=1)
            write([first, second])
            if how == "sighup":
                os.kill(proc.pid, signal.SIGHUP)  # the supervisor's
            else:
                async with httpx.AsyncClient(timeout=RELOAD_BOUND_S) as h:
                    auth = {"authorization": f"Bearer {ADMIN_KEY}"}
                    answer = (await h.post(f"{url}/admin/reload", headers=auth)).json()
                assert answer["workers_told"] == 1 and answer["added"], answer
            after = await worker_views(url, RELOAD_BOUND_S, want_replicas=2)
            assert proc.returncode is None
            text = text_of(log)
    reloaded = {pid for pid, n in after.items() if n == 2}
    assert reloaded == {pid for pid, n in before.items() if n == 1}
    if how == "sighup":
        assert "each of 2 workers reloads the config file in place" in text
    assert "restarting processes" not in text
