"""Reloading pools and replicas from the config file (gateway/fleet/reload.py): POST /admin/reload
under load through a uvicorn-served gateway and simulated replicas, and SIGHUP to `cachelane serve`.

Under load (a bounded loop of concurrent requests with the real openai client, streamed and not,
no client retries): a reload that removes one replica while requests are in flight on it and adds
another fails no request; the requests started after the reload never reach the removed replica,
the added one serves; an invalid file is rejected with its errors and changes nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from gateway.config import load_config
from gateway.http.app import create_app
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from routing.types import Location, Tier
from tests.helpers.servers import running_app, until_serve_ready
from tests.integration.fleet import FAST_COSTS, MODEL, QUICK_CHECKS, default_pool

pytestmark = pytest.mark.slow  # `make check` leaves it out: fleets reloaded under traffic

TENANT_KEY = "tenant-key-" + "t" * 32
ADMIN_KEY = "admin-key-" + "a" * 32
WORKERS = 8
PER_WORKER = 30  # 240 requests in all
MAX_TOKENS = 8  # with ITL_S, a stream lasts ~80 ms: requests are in flight at any moment
ITL_S = 0.01
WAIT_S = 30.0  # bound on every wait


def config_data(replicas: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "auth": {"mode": "keys"},
        "tenants": [{"name": "app", "api_key": TENANT_KEY}],
        "admin": {"api_key": ADMIN_KEY},
        **QUICK_CHECKS,
        "pools": [default_pool(replicas, FAST_COSTS)],
        **extra,
    }


async def sims(stack: AsyncExitStack, n: int) -> list[str]:
    urls = []
    for i in range(n):
        spec = SimReplicaSpec(name=f"sim-{i}", port=0, costs=FAST_COSTS, itl_s=ITL_S)
        urls.append(await stack.enter_async_context(running_app(create_sim_app(spec))))
    return urls


def name_of(url: str) -> str:
    return url.removeprefix("http://")


async def until(what: str, check: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@dataclass
class Sent:
    after_reload: bool  # started once the reload had answered
    replica: str


async def load(
    url: str, sent: list[Sent], failures: list[str], reloaded: asyncio.Event, worker: int
) -> None:
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key=TENANT_KEY, max_retries=0) as client:
        for j in range(PER_WORKER):
            after = reloaded.is_set()
            messages: list[ChatCompletionMessageParam] = [
                {"role": "system", "content": "You are a cache. " * 30},
                {"role": "user", "content": f"worker {worker} request {j}"},
            ]
            try:
                if j % 2:
                    streamed = await client.chat.completions.with_raw_response.create(
                        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True
                    )
                    replica = streamed.headers["x-cachelane-replica"]
                    text = "".join(
                        [
                            c.choices[0].delta.content or ""
                            async for c in streamed.parse()
                            if c.choices
                        ]
                    )
                else:
                    whole = await client.chat.completions.with_raw_response.create(
                        model=MODEL, messages=messages, max_tokens=MAX_TOKENS
                    )
                    replica = whole.headers["x-cachelane-replica"]
                    text = whole.parse().choices[0].message.content or ""
                assert text, "an empty answer"
                sent.append(Sent(after, replica))
            except Exception as err:
                failures.append(f"worker {worker} request {j}: {err!r}")


async def reload(url: str, key: str | None = ADMIN_KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=WAIT_S) as h:
        return await h.post(f"{url}/admin/reload", headers=headers)


async def test_a_reload_under_load_swaps_replicas_without_failing_a_request(
    tmp_path: Path,
) -> None:
    path = tmp_path / "gateway.yaml"
    async with AsyncExitStack() as stack:
        s0, s1, s2, s3 = await sims(stack, 4)
        path.write_text(yaml.safe_dump(config_data([s0, s1, s2])))
        app = create_app(load_config(path), config_path=str(path))
        url = await stack.enter_async_context(running_app(app))
        gw = app.state.gw
        await until(
            "the replicas healthy", lambda: all(r.healthy for r in gw.registry.replicas.values())
        )
        assert (await reload(url, key=None)).status_code == 401
        assert (await reload(url, key="not-the-admin-key-" + "x" * 20)).status_code == 401

        sent: list[Sent] = []
        failures: list[str] = []
        reloaded = asyncio.Event()
        workers = [
            asyncio.create_task(load(url, sent, failures, reloaded, w)) for w in range(WORKERS)
        ]
        leaving = gw.registry.replicas[name_of(s0)]
        await until("requests in flight on the replica to remove", lambda: leaving.in_flight > 0)

        path.write_text(yaml.safe_dump(config_data([s1, "not a url"], tenants_typo=[])))
        rejected = await reload(url)
        assert rejected.status_code == 400, rejected.text
        error = rejected.json()["error"]
        assert error["code"] == "invalid_config"
        assert "pools.0.replicas.1" in error["message"] and "tenants_typo" in error["message"]
        assert set(gw.registry.replicas) == {name_of(u) for u in (s0, s1, s2)}  # unchanged

        path.write_text(yaml.safe_dump(config_data([s1, s2, s3])))
        in_flight_at_reload = leaving.in_flight
        resp = await reload(url)
        reloaded.set()
        assert resp.status_code == 200, resp.text
        report = resp.json()
        assert (report["added"], report["removed"]) == ([name_of(s3)], [name_of(s0)])
        assert report["not_applied"] == []
        assert set(gw.registry.replicas) == {name_of(u) for u in (s1, s2, s3)}

        await asyncio.gather(*workers)
        assert failures == []
        assert len(sent) == WORKERS * PER_WORKER
        assert in_flight_at_reload > 0  # requests were in flight on s0 when it left: they finished
        after = [s.replica for s in sent if s.after_reload]
        assert after and name_of(s0) not in after
        assert name_of(s3) in after

        # drained: its gauges are gone and, after the last request, its index entries
        await until("s0 drained", lambda: name_of(s0) not in gw.fleet.draining)
        async with httpx.AsyncClient() as h:
            metrics = (await h.get(f"{url}/metrics")).text
        assert f'cachelane_replica_healthy{{replica="{name_of(s0)}"}}' not in metrics
        assert 'cachelane_config_reloads_total{result="ok"} 1.0' in metrics
        assert 'cachelane_config_reloads_total{result="invalid"} 1.0' in metrics
        assert gw.index.size(Location(name_of(s0), Tier.HBM)) == 0
        assert gw.index.size(Location(name_of(s3), Tier.HBM)) > 0


async def test_a_reload_reports_sections_it_does_not_apply_and_needs_a_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "gateway.yaml"
    async with AsyncExitStack() as stack:
        s0, s1 = await sims(stack, 2)
        path.write_text(yaml.safe_dump(config_data([s0])))
        with_file = create_app(load_config(path), config_path=str(path))
        url = await stack.enter_async_context(running_app(with_file))
        data = config_data([s0], max_body_bytes=1024)
        data["pools"].append({**data["pools"][0], "name": "more", "replicas": [s1]})
        path.write_text(yaml.safe_dump(data))
        resp = await reload(url)
        assert resp.status_code == 200, resp.text
        assert resp.json()["not_applied"] == ["max_body_bytes"]
        assert resp.json()["pools"] == ["default", "more"]
        assert with_file.state.gw.config.max_body_bytes != 1024
        async with httpx.AsyncClient() as h:  # the cost report follows the pools
            costs = await h.get(
                f"{url}/debug/costs?window_s=60", headers={"authorization": f"Bearer {ADMIN_KEY}"}
            )
        assert [p["pool"] for p in costs.json()["windows"][0]["pools"]] == ["default", "more"]

        without_file = create_app(load_config(path))  # as `serve --replicas` runs
        url = await stack.enter_async_context(running_app(without_file))
        resp = await reload(url)
        assert resp.status_code == 409
        assert resp.json()["error"]["code"] == "no_config_file"


# -- SIGHUP to `cachelane serve --config`, a real process ----------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def served(path: Path) -> AsyncIterator[tuple[str, int, Any]]:
    """`cachelane serve --config PATH` in a subprocess: its URL, pid, and stderr file."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "serve", "--config", str(path), "--port", str(port)]
    with tempfile.TemporaryFile() as stderr:  # not a pipe: a full pipe would block the gateway
        proc = await asyncio.create_subprocess_exec(
            *cmd, stderr=stderr, stdout=subprocess.DEVNULL, env={**os.environ}
        )
        url = f"http://127.0.0.1:{port}"
        try:
            await until_serve_ready(url, proc, WAIT_S)
            yield url, proc.pid, stderr
        finally:
            if proc.returncode is None:
                proc.terminate()
            await asyncio.wait_for(proc.wait(), timeout=WAIT_S)


async def ready_replicas(url: str) -> set[str]:
    async with httpx.AsyncClient() as h:
        return set((await h.get(f"{url}/ready")).json()["replicas"])


async def test_sighup_reloads_the_config_file_and_keeps_it_when_invalid(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    open_auth = {"auth": {"mode": "open"}, "tenants": [], "admin": {}}
    async with AsyncExitStack() as stack:
        s0, s1 = await sims(stack, 2)
        path.write_text(yaml.safe_dump(config_data([s0]) | open_auth))
        async with served(path) as (url, pid, stderr):
            assert await ready_replicas(url) == {name_of(s0)}
            path.write_text(yaml.safe_dump(config_data([s0, s1]) | open_auth))
            os.kill(pid, signal.SIGHUP)
            deadline = time.monotonic() + WAIT_S
            while await ready_replicas(url) != {name_of(s0), name_of(s1)}:
                assert time.monotonic() < deadline, "SIGHUP did not add the replica"
                await asyncio.sleep(0.1)

            path.write_text("pools: [\n")  # not YAML
            os.kill(pid, signal.SIGHUP)
            deadline = time.monotonic() + WAIT_S
            while b"config reload rejected" not in (stderr.seek(0) or stderr.read()):
                assert time.monotonic() < deadline, "the rejected reload was not logged"
                await asyncio.sleep(0.1)
            assert await ready_replicas(url) == {name_of(s0), name_of(s1)}
