"""Every byte has a deadline: a stream whose replica breaks its chunked framing mid-way (a bad
chunk header, then the connection closed: aiohttp 3.14 then waits on it without end, its read
timeout never firing) ends with an error event within the idle deadline
(gateway/serving/deadline.py idle_deadline_s), and is counted. The replica is its own process,
`python -m loadtest.bench.faulty_replica --mode midgarbage`; the gateway runs under uvicorn on
loopback."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from gateway.http.app import create_app
from gateway.serving.deadline import idle_deadline_s
from loadtest.bench.faulty_replica import EVENTS
from loadtest.bench.processes import ManagedProcess, wait_ready
from tests.helpers.ports import free_port
from tests.helpers.servers import running_app
from tests.integration.fleet import MODEL, gateway_config

CLIENT_TIMEOUT_S = 30.0  # far past the idle deadline (4 s with the pool's defaults)


@contextmanager
def mid_garbage(log_dir: Path) -> Iterator[str]:
    """The replica process, ready; yields its base URL."""
    port = free_port()
    args = [sys.executable, "-m", "loadtest.bench.faulty_replica", "--mode", "midgarbage"]
    proc = ManagedProcess(
        "midgarbage replica",
        [*args, "--port", str(port), "--model", MODEL],
        log_dir / "midgarbage.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        proc.start()
        wait_ready(proc, [f"{url}/health"])
        yield url
    finally:
        proc.stop()


async def test_a_stream_broken_mid_way_ends_with_an_error_event_in_its_idle_deadline(
    tmp_path: Path,
) -> None:
    with mid_garbage(tmp_path) as url:
        app = create_app(gateway_config([url], health={"eject_after_errors": 0}))
        async with running_app(app) as gateway_url:
            registry = app.state.gw.registry
            for _ in range(100):  # its first health check, within ~5 s
                if all(r.healthy for r in registry.replicas.values()):
                    break
                await asyncio.sleep(0.05)
            pool = next(iter(registry.replicas.values())).pool
            assert idle_deadline_s(pool) < CLIENT_TIMEOUT_S
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
                "stream": True,
            }
            async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as h:
                r = await h.post(f"{gateway_url}/v1/chat/completions", json=body)
            assert r.status_code == 200
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert len(events) == EVENTS + 1
            error = json.loads(events[-1])["error"]
            assert error["code"] in ("upstream_timeout", "upstream_unavailable"), error
            sample = app.state.gw.metrics.registry.get_sample_value
            name = url.removeprefix("http://")
            assert sample("cachelane_upstream_streams_broken_total", {"replica": name}) == 1


async def test_a_whole_answer_with_no_output_bound_has_a_deadline_too(tmp_path: Path) -> None:
    """No max_tokens and no max_model_len: the whole answer's deadline is the upstream read
    timeout (here 2 s), enforced by the gateway itself, so the same broken framing cannot hold
    it (aiohttp's own read timeout never fires on it)."""
    with mid_garbage(tmp_path) as url:
        config = gateway_config(
            [url], health={"eject_after_errors": 0}, upstream={"read_timeout_s": 2.0}
        )
        app = create_app(config)
        async with running_app(app) as gateway_url:
            registry = app.state.gw.registry
            for _ in range(100):  # its first health check, within ~5 s
                if all(r.healthy for r in registry.replicas.values()):
                    break
                await asyncio.sleep(0.05)
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as h:
                r = await h.post(f"{gateway_url}/v1/chat/completions", json=body)
            assert r.status_code == 504, r.text
            assert r.json()["error"]["code"] == "upstream_timeout"
