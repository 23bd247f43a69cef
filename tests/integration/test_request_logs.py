"""Request ids and logs on real servers: simulated replicas and a gateway on
loopback, the official openai client.

- `x-request-id`: a safe one from the client is kept, an unsafe or missing one replaced by a
  generated one; either way it is echoed on the response and forwarded to the replica (each
  replica here records the headers it was sent);
- `cachelane serve --log-format json` (a subprocess, its stderr read): every line is a JSON object,
  one access line per request with the request's fields (a streamed request with its TTFT and the
  engine's usage, an error with its status and code), the request's other lines carry its id, and
  no httpx/httpcore line (health checks) appears;
- ejections and re-admissions are logged once each, the passive ejection with the id of the
  request that caused it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.http.app import create_app
from gateway.telemetry.logs import RequestIdFilter
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from tests.helpers.completions import streamed_usage
from tests.helpers.servers import running_app, until_serve_ready
from tests.integration.fleet import FAST_COSTS, MODEL, gateway_config
from tests.integration.test_failing_replicas import body, mixed_fleet, until

pytestmark = pytest.mark.slow  # `make check` leaves it out: gateway subprocesses

MESSAGES: Any = [{"role": "user", "content": "You are a helpful assistant. " * 10}]


@dataclass
class HeaderCapture:
    """ASGI wrapper around a replica: records the headers of every POST it is sent."""

    app: ASGIApp
    seen: list[dict[str, str]] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            self.seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await self.app(scope, receive, send)


async def captured_replicas(stack: AsyncExitStack, n: int) -> tuple[list[str], list[HeaderCapture]]:
    """`n` simulated replicas, each behind a HeaderCapture, served until `stack` closes: their
    URLs and captures."""
    captures, urls = [], []
    for i in range(n):
        spec = SimReplicaSpec(name=f"sim-{i}", port=0, costs=FAST_COSTS, itl_s=0.001)
        capture = HeaderCapture(create_sim_app(spec))
        captures.append(capture)
        urls.append(await stack.enter_async_context(running_app(capture)))
    return urls, captures


@asynccontextmanager
async def captured_fleet(n: int = 2) -> AsyncIterator[tuple[str, list[HeaderCapture]]]:
    async with AsyncExitStack() as stack:
        urls, captures = await captured_replicas(stack, n)
        app = create_app(gateway_config(urls))
        url = await stack.enter_async_context(running_app(app))
        # a start-up health check that timed out on a busy loop leaves its replica out until the
        # next one (a CI run where a request here got 503)
        await until(lambda: bool(app.state.gw.registry.healthy_for(MODEL)), timeout_s=10.0)
        yield url, captures


def upstream_ids(captures: list[HeaderCapture]) -> list[str | None]:
    return [h.get("x-request-id") for c in captures for h in c.seen]


async def test_a_client_request_id_is_echoed_and_forwarded_to_the_replica() -> None:
    async with captured_fleet() as (url, captures):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            extra_headers={"x-request-id": "trace-abc_123.4:5"},
        )
        assert raw.headers["x-request-id"] == "trace-abc_123.4:5"
        assert upstream_ids(captures) == ["trace-abc_123.4:5"]

        # streamed too: the id is on the stream's response and at the replica
        stream = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            stream=True,
            extra_headers={"x-request-id": "stream-1"},
        )
        async for _ in stream.parse():
            pass
        assert stream.headers["x-request-id"] == "stream-1"
        assert upstream_ids(captures)[-1] == "stream-1"


@pytest.mark.parametrize(
    "given",
    [None, "", "a" * 129, "has space", 'quote"d', "semi;colon", "é-unicode"],
    ids=["missing", "empty", "too-long", "space", "quote", "semicolon", "non-ascii"],
)
async def test_a_missing_or_unsafe_request_id_is_replaced_by_a_generated_one(
    given: str | None,
) -> None:
    async with captured_fleet(1) as (url, captures):
        headers = {} if given is None else {b"x-request-id": given.encode("utf-8")}
        async with httpx.AsyncClient(timeout=10.0) as h:
            r = await h.post(
                f"{url}/v1/chat/completions",
                json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
                headers=headers,
            )
            r2 = await h.post(
                f"{url}/v1/chat/completions",
                json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
                headers=headers,
            )
        assert r.status_code == 200
        generated = r.headers["x-request-id"]
        assert len(generated) == 32 and int(generated, 16) >= 0
        assert upstream_ids(captures) == [generated, r2.headers["x-request-id"]]
        assert generated != r2.headers["x-request-id"]  # one per request


async def test_an_error_answer_carries_its_request_id() -> None:
    async with captured_fleet(1) as (url, captures):
        async with httpx.AsyncClient(timeout=10.0) as h:
            r = await h.post(
                f"{url}/v1/chat/completions", content=b"{not json", headers={"x-request-id": "e1"}
            )
        assert r.status_code == 400
        assert r.headers["x-request-id"] == "e1"
        assert captures[0].seen == []


# -- cachelane serve --log-format json, a real process ------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def served(replicas: list[str], *args: str) -> AsyncIterator[tuple[str, list[str]]]:
    """`cachelane serve` in a subprocess; yields its URL and a list that, once the block has
    ended and the gateway exited, holds its stderr lines."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "serve", "--port", str(port), *args]
    if replicas:  # else `args` give a --config
        cmd += ["--replicas", ",".join(replicas)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    lines: list[str] = []
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as stderr:  # not a pipe: a full pipe would block the gateway
        proc = await asyncio.create_subprocess_exec(
            *cmd, stderr=stderr, stdout=subprocess.DEVNULL, env=env
        )
        try:
            await until_serve_ready(url, proc, 20)
            yield url, lines
        finally:
            if proc.returncode is None:
                proc.terminate()
            await asyncio.wait_for(proc.wait(), timeout=20)
            stderr.seek(0)
            lines.extend(stderr.read().decode().splitlines())


async def test_serve_log_format_json_writes_one_access_line_per_request() -> None:
    async with AsyncExitStack() as stack:
        urls = []
        for i in range(2):
            spec = SimReplicaSpec(name=f"sim-{i}", port=0, costs=FAST_COSTS, itl_s=0.001)
            urls.append(await stack.enter_async_context(running_app(create_sim_app(spec))))
        async with served(urls, "--log-format", "json", "--log-level", "debug") as (url, lines):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            usage = await streamed_usage(
                client, MODEL, MESSAGES, extra_headers={"x-request-id": "streamed-1"}
            )
            assert usage is not None
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(
                    model="no-such-model",
                    messages=MESSAGES,
                    extra_headers={"x-request-id": "error-1"},
                )
            async with httpx.AsyncClient() as h:
                bad = await h.post(f"{url}/v1/completions", content=b"[1, 2")
            bad_id = bad.headers["x-request-id"]
            await asyncio.sleep(0.5)  # a few health checks go by

    records = [json.loads(line) for line in lines]  # every line is JSON
    assert records, "no log line"
    for r in records:
        assert {"ts", "level", "logger", "msg"} <= r.keys()
    access = [r for r in records if r["logger"] == "cachelane.access" and r["level"] == "INFO"]
    by_id = {r["request_id"]: r for r in access}
    assert len(access) == len(by_id) == 3, access  # one line per request

    streamed = by_id["streamed-1"]
    assert streamed["method"] == "POST" and streamed["path"] == "/v1/chat/completions"
    assert streamed["status"] == 200 and streamed["code"] is None
    assert streamed["tenant"] == "anonymous" and streamed["class"] == "standard"
    assert streamed["model"] == MODEL
    assert streamed["replica"] in {u.removeprefix("http://") for u in urls}
    assert streamed["reason"]
    assert 0 < streamed["ttft_ms"] <= streamed["e2e_ms"]
    assert streamed["prompt_tokens"] == usage.prompt_tokens
    details = usage.prompt_tokens_details
    assert streamed["cached_tokens"] == (details.cached_tokens if details else None)

    error = by_id["error-1"]
    assert error["status"] == 404 and error["code"] == "model_not_found"
    assert error["model"] is None and error["replica"] is None and error["ttft_ms"] is None
    assert error["e2e_ms"] > 0
    invalid = by_id[bad_id]
    assert invalid["status"] == 400 and invalid["code"]

    # the request's other lines (the route decision at DEBUG) carry its id
    routed = [r for r in records if r["logger"] == "cachelane.app" and "route" in r["msg"]]
    assert [r.get("request_id") for r in routed] == ["streamed-1"]
    # no per-request line from the HTTP client (health checks), no id outside a request
    assert not [r for r in records if r["logger"].startswith(("httpx", "httpcore"))]
    assert any(r["logger"].startswith("uvicorn") for r in records)  # uvicorn's own, as JSON
    assert all("request_id" not in r for r in records if r["logger"].startswith("uvicorn"))


async def test_serve_text_format_writes_the_access_line_as_key_values() -> None:
    async with AsyncExitStack() as stack:
        spec = SimReplicaSpec(name="sim-0", port=0, costs=FAST_COSTS, itl_s=0.001)
        replica = await stack.enter_async_context(running_app(create_sim_app(spec)))
        async with served([replica]) as (url, lines):
            async with httpx.AsyncClient(timeout=10.0) as h:
                r = await h.post(
                    f"{url}/v1/chat/completions",
                    json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
                    headers={"x-request-id": "text-1"},
                )
                assert r.status_code == 200
            await asyncio.sleep(0.3)
    access = [line for line in lines if "cachelane.access:" in line]
    assert len(access) == 1, lines
    line = access[0]
    for part in ("request_id=text-1", "status=200", f"model={MODEL}", "tenant=anonymous"):
        assert part in line, line
    assert " e2e_ms=" in line and " ttft_ms=- " in line  # not streamed: no TTFT
    assert not [line for line in lines if " httpx:" in line or " httpcore" in line], lines


# -- ejections and re-admissions, logged once -------------------------------------------------


async def test_ejection_and_readmission_are_logged_once_each_with_the_request_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    caplog.handler.addFilter(RequestIdFilter())
    async with mixed_fleet("error", sims=1, eject_after_errors=2, ejection_s=0.5) as m:
        async with httpx.AsyncClient(base_url=m.gateway_url, timeout=10.0) as h:
            for i in range(20):  # the faulty replica answers its share with 500s
                await h.post(
                    "/v1/chat/completions", json=body(i), headers={"x-request-id": f"req-{i}"}
                )
        faulty = m.replica(m.faulty_name)
        assert not faulty.healthy
        served = [
            r.access["request_id"]  # type: ignore[attr-defined]
            for r in caplog.records
            if r.name == "cachelane.access" and r.access["status"] == 200  # type: ignore[attr-defined]
        ]
        assert len(served) == 20  # its 500s were retried on the healthy replica
        m.faulty.mode = "ok"  # recovered: its probe generation passes after the back-off
        await until(lambda: faulty.healthy, timeout_s=5.0)
        await asyncio.sleep(0.5)  # checks keep passing: nothing more is said

    def about(word: str) -> list[logging.LogRecord]:
        return [
            r
            for r in caplog.records
            if r.name == "cachelane.registry"
            and m.faulty_name in r.getMessage()
            and word in r.getMessage()
        ]

    suspect = about("suspect")  # all of one tenant's errors (auth is open): its probe decides
    assert len(suspect) == 1
    assert getattr(suspect[0], "request_id", None) in served  # the request that tipped it
    ejected = about("ejected")
    assert len(ejected) == 1
    assert getattr(ejected[0], "request_id", None) is None  # by the health checker's probe
    admitted = about("admitted")
    assert len(admitted) == 2  # at start-up, and once after the ejection
    assert getattr(admitted[1], "request_id", None) is None  # the health check's, no request
    assert not [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))]
