"""A client that leaves while it is still sending its request body (found by the soak benchmark:
an abandoning client hung up mid-body and the gateway logged a traceback and counted a 500).

A raw TCP client against a real gateway (uvicorn on loopback) in front of a simulated replica:
it sends the headers and part of a declared body, then closes. The gateway counts the request
as `client_closed` (499), logs no traceback, and serves the next client.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import httpx
import pytest

from tests.integration.fleet import MODEL, fleet
from tests.integration.test_failing_replicas import until
from tests.integration.test_input import errors_by_code

PARTIAL_BODY = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "'


async def send_part_and_leave(gateway_url: str) -> None:
    url = urlsplit(gateway_url)
    assert url.hostname is not None and url.port is not None
    _, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        b"Host: " + url.netloc.encode() + b"\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: 10000\r\n\r\n" + PARTIAL_BODY
    )
    await writer.drain()
    await asyncio.sleep(0.2)  # the gateway is now waiting for the rest of the body
    writer.close()
    await writer.wait_closed()


async def test_a_client_leaving_mid_body_is_a_499_not_a_500(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with fleet(1) as f, httpx.AsyncClient(base_url=f.gateway_url, timeout=10.0) as h:
        with caplog.at_level(logging.ERROR):
            await send_part_and_leave(f.gateway_url)

            async def counted() -> dict[str, float]:
                return errors_by_code((await h.get("/metrics")).text)

            seen: dict[str, float] = {}

            async def poll() -> bool:
                seen.update(await counted())
                return seen.get("client_closed", 0) >= 1

            deadline = asyncio.get_running_loop().time() + 5
            while not await poll():
                assert asyncio.get_running_loop().time() < deadline, seen
                await asyncio.sleep(0.05)
        assert "internal_error" not in seen, seen
        # the gateway's own records: a garbage-collected task of an earlier test may log too
        gateway_errors = [
            r
            for r in caplog.records
            if r.levelno >= logging.ERROR and r.name.startswith("cachelane.")
        ]
        assert not gateway_errors, [r.getMessage() for r in gateway_errors]
        await until(lambda: all(r.in_flight == 0 for r in f.gw.registry.replicas.values()))
        ok = await h.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert ok.status_code == 200
