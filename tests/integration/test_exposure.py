"""What the gateway exposes, on real servers: read deadlines against raw
sockets that send half a request, keys on /metrics and /ready, the OpenAPI pages off by default,
engine-control body fields refused, failed authentications limited per address and per key
(never a valid key), X-Forwarded-For taken from trusted proxies only, and the
published example keys refused at start."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from gateway.cli.main import main
from gateway.config import ConfigError
from gateway.http.app import create_app
from gateway.http.exposure import HTTP_PROTOCOL, MAX_AUTH_HOLD_S
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from tests.helpers.servers import running_app
from tests.integration.fleet import FAST_COSTS, MODEL, gateway_config

pytestmark = pytest.mark.slow  # `make check` leaves it out: `cachelane serve` subprocesses

KEY = "web-key-exposure-0123456789abcdef0123456"
VOICE_KEY = "voice-key-exposure-0123456789abcdef01234"
ADMIN = "admin-key-exposure-0123456789abcdef01234"
MONITOR = "monitor-key-exposure-0123456789abcdef012"
TENANTS = [
    {"name": "web", "api_key": KEY},
    {"name": "voice", "api_key": VOICE_KEY, "class": "critical"},
]
CLOSE_WAIT_S = 10.0  # bound on waiting for the gateway to close a connection
START_BOUND_S = 30.0  # bound on `cachelane serve` starting: a broken start, not a timing


@asynccontextmanager
async def gateway(**extra: Any) -> AsyncIterator[tuple[str, Any]]:
    """A gateway served as `cachelane serve` serves it (its HTTP protocol), one sim replica."""
    async with AsyncExitStack() as stack:
        spec = SimReplicaSpec(name="sim-0", port=0, costs=FAST_COSTS, itl_s=0.0005)
        replica = await stack.enter_async_context(running_app(create_sim_app(spec)))
        extra.setdefault("tenants", TENANTS)
        config = gateway_config([replica], **extra)
        app = create_app(config)
        served = running_app(
            app, http=HTTP_PROTOCOL, forwarded_allow_ips=config.listen.trusted_proxies
        )  # as `cachelane serve` runs it
        url = await stack.enter_async_context(served)
        yield url, app


def metric(app: Any, name: str, **labels: str) -> float:
    return app.state.gw.metrics.registry.get_sample_value(name, labels) or 0.0


async def raw_connection(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return await asyncio.open_connection(parts.hostname, parts.port)


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (bounded in time)."""
    async with asyncio.timeout(CLOSE_WAIT_S):
        return await reader.read()  # to EOF


# --- read deadlines ------------------------------------------------------------------------


async def test_half_sent_headers_and_idle_connections_are_closed() -> None:
    async with gateway(listen={"header_timeout_s": 0.5}) as (url, app):
        half_reader, half = await raw_connection(url)
        half.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # no blank line
        await half.drain()
        idle_reader, idle = await raw_connection(url)  # sends nothing at all
        assert await read_until_closed(half_reader) == b""
        assert await read_until_closed(idle_reader) == b""
        half.close()
        idle.close()
        assert metric(app, "cachelane_read_timeouts_total", part="headers") == 2


async def test_the_header_deadline_spares_requests_and_keep_alive_follow_ups() -> None:
    """Requests slower than the header deadline to answer, and a second request on the same
    connection after the first, are served: the deadline covers only the headers' arrival."""
    async with gateway(listen={"header_timeout_s": 0.5}) as (url, app):
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as c:
            for _ in range(2):  # one pooled connection, used twice
                answer = await c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1200
                )  # ~0.6 s of decoding: longer than the header deadline
                assert answer.choices[0].message.content
                await asyncio.sleep(0.2)
        assert metric(app, "cachelane_read_timeouts_total", part="headers") == 0


async def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_connection_closed() -> None:
    async with gateway(listen={"body_timeout_s": 0.5}) as (url, app):
        reader, writer = await raw_connection(url)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            + f"authorization: Bearer {KEY}\r\n".encode()
            + b"content-type: application/json\r\ncontent-length: 100\r\n\r\n"
            + b'{"model": '  # 10 of the 100 bytes promised
        )
        await writer.drain()
        answer = await read_until_closed(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert b'"code":"request_timeout"' in answer
        assert metric(app, "cachelane_read_timeouts_total", part="body") == 1
        assert metric(app, "cachelane_errors_total", code="request_timeout") == 1


# --- /metrics, /ready, the OpenAPI pages ----------------------------------------------------


async def test_metrics_and_ready_are_open_by_default_and_docs_are_off() -> None:
    async with gateway() as (url, _), httpx.AsyncClient(base_url=url) as h:
        assert (await h.get("/metrics")).status_code == 200
        assert (await h.get("/ready")).status_code == 200
        for path in ("/docs", "/redoc", "/openapi.json"):
            resp = await h.get(path)
            assert resp.status_code == 404, path
            assert resp.json()["error"]["code"] == "not_found"


async def test_metrics_and_ready_take_the_monitoring_or_admin_key() -> None:
    exposure = {"metrics_auth": True, "ready_auth": True, "api_key": MONITOR, "docs": True}
    async with (
        gateway(exposure=exposure, admin={"api_key": ADMIN}) as (url, _),
        httpx.AsyncClient(base_url=url) as h,
    ):
        for path in ("/metrics", "/ready"):
            assert (await h.get(path)).status_code == 401, path
            tenant = {"authorization": f"Bearer {KEY}"}
            assert (await h.get(path, headers=tenant)).status_code == 401, path
            for key in (MONITOR, ADMIN):
                resp = await h.get(path, headers={"authorization": f"Bearer {key}"})
                assert resp.status_code == 200, path
        assert (await h.get("/health")).status_code == 200  # liveness stays open
        assert (await h.get("/openapi.json")).status_code == 200  # enabled


def test_a_protected_metrics_endpoint_needs_a_key_to_check() -> None:
    with pytest.raises(ConfigError, match=r"exposure\.metrics_auth"):
        gateway_config(["http://127.0.0.1:1"], tenants=TENANTS, exposure={"metrics_auth": True})


# --- body fields ----------------------------------------------------------------------------


async def test_engine_control_fields_are_refused_unless_the_class_may_send_them() -> None:
    fields = {"allow": {"critical": ["priority"]}}
    async with gateway(body_fields=fields) as (url, app):
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as web:
            for field, value in (("priority", -10), ("kv_transfer_params", {"do_remote": 1})):
                with pytest.raises(openai.BadRequestError) as err:
                    await web.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": "hi"}],
                        max_tokens=1,
                        extra_body={field: value},
                    )
                assert err.value.body["code"] == "field_not_allowed"  # type: ignore[index]
                assert err.value.body["param"] == field  # type: ignore[index]
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key=VOICE_KEY, max_retries=0) as voice:
            await voice.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=1,
                extra_body={"priority": 0},
            )
        assert metric(app, "cachelane_errors_total", code="field_not_allowed") == 2


# --- failed authentication ------------------------------------------------------------------


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
BAD = {"authorization": "Bearer wrong-key-0123456789abcdef0123456789"}
GOOD = {"authorization": f"Bearer {KEY}"}


async def models_statuses(h: httpx.AsyncClient, headers: list[dict[str, str]]) -> list[int]:
    """GET /v1/models once with each of `headers`, in turn: the status codes."""
    return [(await h.get("/v1/models", headers=x)).status_code for x in headers]


async def test_an_address_that_fails_authentication_too_often_gets_429() -> None:
    async with gateway(rate_limits={"failed_auth_per_min": 3}) as (url, app):
        async with httpx.AsyncClient(base_url=url) as h:
            for _ in range(3):
                assert (
                    await h.post("/v1/chat/completions", json=CHAT, headers=BAD)
                ).status_code == 401
            throttled = await h.post("/v1/chat/completions", json=CHAT, headers=BAD)
            assert throttled.status_code == 429
            assert throttled.headers["retry-after"] == "20"  # one more failure fits in 60/3 s
            assert throttled.json()["error"]["code"] == "too_many_failed_auth"
            assert (await h.get("/v1/models")).status_code == 429  # no key: refused unread
        assert metric(app, "cachelane_auth_throttled_total") == 2


async def test_a_valid_key_is_served_after_bad_keys_from_its_address() -> None:
    """Behind a proxy every client shares its address: one client's bad keys must not lock out
    a tenant whose key is valid (the default limit, 30 a minute, overrun)."""
    async with gateway() as (url, _app):
        async with httpx.AsyncClient(base_url=url) as h:
            answers = [
                (await h.post("/v1/chat/completions", json=CHAT, headers=BAD)).status_code
                for _ in range(35)
            ]
            assert answers[:30] == [401] * 30 and set(answers[30:]) == {429}
            assert (await h.get("/v1/models")).status_code == 429
            served = await h.post("/v1/chat/completions", json=CHAT, headers=GOOD)
            assert served.status_code == 200, served.text
            voice = {"authorization": f"Bearer {VOICE_KEY}"}
            assert (await h.get("/v1/models", headers=voice)).status_code == 200
            # a fresh bad key from the held address: its failure is the 429, not a 401
            other = {"authorization": "Bearer another-wrong-key-0123456789abcdef0123"}
            assert (await h.get("/v1/models", headers=other)).status_code == 429


async def test_a_bad_key_is_held_whatever_address_it_comes_from() -> None:
    async with gateway(
        rate_limits={"failed_auth_per_min": 3}, listen={"forwarded_allow_ips": ["127.0.0.1"]}
    ) as (url, _app):
        async with httpx.AsyncClient(base_url=url) as h:
            hops = [{**BAD, "x-forwarded-for": f"203.0.113.{i + 1}"} for i in range(3)]
            fresh = {**BAD, "x-forwarded-for": "198.51.100.9"}  # a new address, the same key
            assert await models_statuses(h, [*hops, fresh]) == [401, 401, 401, 429]


async def test_a_forged_forwarded_for_from_an_untrusted_peer_is_ignored() -> None:
    """No proxy is trusted by default, not even loopback: the peer's address counts."""
    async with gateway(rate_limits={"failed_auth_per_min": 3}) as (url, _app):
        async with httpx.AsyncClient(base_url=url) as h:
            forged = [{"x-forwarded-for": f"203.0.113.{i + 1}"} for i in range(3)]
            escape = {"x-forwarded-for": "198.51.100.9"}
            assert await models_statuses(h, [*forged, escape]) == [401, 401, 401, 429]


async def test_a_trusted_proxys_forwarded_for_names_the_client() -> None:
    async with gateway(
        rate_limits={"failed_auth_per_min": 3}, listen={"forwarded_allow_ips": ["127.0.0.1"]}
    ) as (url, _app):
        async with httpx.AsyncClient(base_url=url) as h:
            held = {"x-forwarded-for": "203.0.113.7"}
            other = {"x-forwarded-for": "198.51.100.9"}  # another client behind the proxy
            assert await models_statuses(h, [held] * 4 + [other]) == [401, 401, 401, 429, 401]


# --- example keys ---------------------------------------------------------------------------

EXAMPLE_KEY = "change-me-app-key-00000000000000000000"  # deploy/k8s/base/secrets/app-key


def test_the_published_example_keys_are_refused_outside_the_dev_flag() -> None:
    tenants = [{"name": "app", "api_key": EXAMPLE_KEY}]
    with pytest.raises(ConfigError, match=r"tenants\.0 \('app'\)\.api_key: an example value"):
        gateway_config(["http://127.0.0.1:1"], tenants=tenants)
    allowed = gateway_config(
        ["http://127.0.0.1:1"],
        tenants=tenants,
        auth={"mode": "keys", "allow_example_keys": True},
    )
    assert allowed.tenants[0].api_key == EXAMPLE_KEY


def test_serve_refuses_to_start_with_an_example_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = tmp_path / "app-key"
    secret.write_text(EXAMPLE_KEY + "\n")
    path = tmp_path / "gateway.yaml"
    path.write_text(
        "pools: [{name: p, replicas: ['http://127.0.0.1:1']}]\n"
        f"tenants: [{{name: app, api_key_file: {secret}}}]\n"
    )
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "an example value published in this repository" in err
    assert EXAMPLE_KEY not in err


# --- as `cachelane serve` runs it -----------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
async def test_cachelane_serve_closes_half_sent_requests(tmp_path: Path, workers: int) -> None:
    """The real command, one process or two workers (the protocol is named by import path)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}, header_timeout_s: 0.5}}\n"
        "auth: {mode: open}\n"
        "pools: [{name: p, replicas: ['http://127.0.0.1:1']}]\n"
    )
    cmd = [sys.executable, "-m", "gateway", "serve", "--config", str(config)]
    cmd += ["--workers", str(workers), "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        async with asyncio.timeout(START_BOUND_S), httpx.AsyncClient() as h:
            while True:
                assert proc.returncode is None, "cachelane serve exited"
                with contextlib.suppress(httpx.HTTPError):
                    if (await h.get(f"{url}/health")).status_code == 200:
                        break
                await asyncio.sleep(0.05)
        for _ in range(workers):  # new connections: each worker may take one
            reader, writer = await raw_connection(url)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            await writer.drain()
            assert await read_until_closed(reader) == b""
            writer.close()
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), timeout=30)


DECISION = "x-cachelane-replica"
ESTIMATE = "x-cachelane-est-terms-ms"


@pytest.mark.parametrize(
    ("decision", "estimate"),
    [("all", "admin"), ("admin", "none"), ("none", "all")],
    ids=["all-admin", "admin-none", "none-all"],
)
async def test_decision_and_estimate_headers_reach_their_audience(
    decision: str, estimate: str
) -> None:
    exposure = {"decision_headers": decision, "estimate_headers": estimate}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    tenant = {"authorization": f"Bearer {KEY}"}
    operator = tenant | {"x-cachelane-admin-key": ADMIN}
    impostor = tenant | {"x-cachelane-admin-key": KEY}
    async with (
        gateway(exposure=exposure, admin={"api_key": ADMIN}) as (url, _),
        httpx.AsyncClient(base_url=url) as h,
    ):
        seen = {}
        for who, headers in (("tenant", tenant), ("operator", operator), ("impostor", impostor)):
            for stream in (False, True):
                resp = await h.post(
                    "/v1/chat/completions", json=body | {"stream": stream}, headers=headers
                )
                assert resp.status_code == 200
                seen[who, stream] = (DECISION in resp.headers, ESTIMATE in resp.headers)
    expected = {
        "tenant": (decision == "all", estimate == "all"),
        "operator": (decision != "none", estimate != "none"),
        "impostor": (decision == "all", estimate == "all"),
    }
    assert seen == {(who, s): expected[who] for who in expected for s in (False, True)}


async def test_head_on_health_and_ready_answers_the_status_without_a_body() -> None:
    async with gateway() as (url, _), httpx.AsyncClient(base_url=url) as h:
        for path in ("/health", "/ready"):
            resp = await h.head(path)
            assert (resp.status_code, resp.content) == (200, b""), path
    config = gateway_config(["http://127.0.0.1:1"], tenants=TENANTS)  # nothing listens there
    async with running_app(create_app(config)) as url, httpx.AsyncClient(base_url=url) as h:
        resp = await h.head("/ready")
        assert (resp.status_code, resp.content) == (503, b"")
        assert (await h.head("/health")).status_code == 200


async def test_keyless_endpoints_stay_open_and_the_hold_is_capped() -> None:
    """A load balancer's health checks share the address of the clients behind it: bad keys from
    that address never hold /health, /ready or /metrics, and however many it sends, the hold on
    the rest ends within a minute of the last."""
    async with gateway(rate_limits={"failed_auth_per_min": 3}) as (url, _app):
        async with httpx.AsyncClient(base_url=url) as h:
            statuses = await models_statuses(h, [BAD] * 40)
            assert statuses[:3] == [401] * 3 and set(statuses[3:]) == {429}
            for path in ("/health", "/ready", "/metrics"):
                assert (await h.get(path)).status_code == 200, path
                assert (await h.get(path, headers=BAD)).status_code == 200, path
            assert (await h.get("/v1/models")).status_code == 429  # the rest stays held
            for _ in range(300):  # at 20 s a failure, uncapped this would hold for 6,800 s
                held = await h.get("/v1/models", headers=BAD)
            assert held.status_code == 429
            assert int(held.headers["retry-after"]) <= MAX_AUTH_HOLD_S


async def test_failed_auth_state_is_dropped_once_its_hold_is_over() -> None:
    """Per-address state is bounded: a party is forgotten once its hold is over (here 10 ms a
    failure at 6,000 a minute), so 300 addresses that failed once leave a handful behind."""
    async with gateway(
        rate_limits={"failed_auth_per_min": 6000}, listen={"forwarded_allow_ips": ["127.0.0.1"]}
    ) as (url, app):
        async with httpx.AsyncClient(base_url=url) as h:
            for i in range(300):
                hop = {**BAD, "x-forwarded-for": f"203.0.{i // 250}.{i % 250 + 1}"}
                assert (await h.get("/v1/models", headers=hop)).status_code == 401
        assert len(app.state.auth_failures) < 50  # 301 parties without forgetting
