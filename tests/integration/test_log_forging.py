"""Issue 29, item 3: no client can write a line of its own into the log. A real `cachelane serve`
(a subprocess, its stderr read) gets control characters, tabs, quotes, a right-to-left override
and a forged log line in the path, the headers, the model and tenant names; its log keeps one
line per record in both formats, and one access line per request."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest

from gateway.telemetry.logs import TextFormatter
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from tests.helpers.servers import running_app
from tests.integration.fleet import FAST_COSTS, MODEL
from tests.integration.test_request_logs import served

ADMIN_KEY = "admin-key-" + "a" * 32
WEB_KEY = "web-key-" + "w" * 32
FORGED = "%0A2026-12-04%2018:31:00,000%09WARNING%09cachelane.tenants:%09forged"
RECORD_START = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) \S+: ")
CONFIG = """\
engine_metrics: {{enabled: false}}
admin: {{api_key: "{admin}"}}
tenants: [{{name: web, api_key: "{web}"}}]
pools: [{{name: p, models: [{model}], replicas: ["{replica}"]}}]
"""


async def raw_request(url: str, head: bytes) -> bytes:
    """One HTTP/1.1 request written byte for byte: header values with tabs and bytes above 0x7f
    (obs-text, RFC 9110 5.5), which httpx would refuse; control characters other than the tab
    are refused by uvicorn's parser before any code of the gateway's sees them."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head)
        await writer.drain()
        return await asyncio.wait_for(reader.read(65536), timeout=10)
    finally:
        writer.close()


async def hostile_requests(url: str) -> int:
    """Sends them; returns how many requests the gateway answered (each one access line)."""
    web = {"authorization": f"Bearer {WEB_KEY}"}
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    sent = 0
    async with httpx.AsyncClient(timeout=10) as h:
        for path in (f"/x{FORGED}", f"/v1/chat/completions{FORGED}", "/v1/%1b[31mred%E2%80%AE"):
            await h.get(url + path)
            sent += 1
        body = {"model": f"m{FORGED}\n\t\"'", "messages": [{"role": "user", "content": "hi"}]}
        assert (await h.post(f"{url}/v1/chat/completions", json=body, headers=web)).is_error
        sent += 1
        for name in (f"ev{FORGED}il", "we%E2%80%AEb", "a%22b%3Dc"):
            r = await h.put(
                f"{url}/admin/tenants/{name}", json={"api_key": "k" * 40}, headers=admin
            )
            assert r.status_code == 400, r.text
            sent += 1
        tenant = {**admin, "x-cachelane-tenant": "web\tforged\u00e9".encode()}
        routed = await h.post(f"{url}/debug/route", json=body, headers=tenant)  # type: ignore[arg-type]
        assert routed.status_code == 404, routed.text
        sent += 1
    for head in (
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-request-id: a\tb\xe2\x80\xae\r\n"
        b'authorization: Bearer \t\xff"=\xe2\x80\xa8\r\nconnection: close\r\n\r\n',
        b"GET /v1/models?q=%0A HTTP/1.1\r\nhost: x\r\nx-cachelane-class: \tbatch\x85\r\n"
        b"authorization: Bearer " + WEB_KEY.encode() + b"\r\nconnection: close\r\n\r\n",
    ):
        assert (await raw_request(url, head)).startswith(b"HTTP/1.1 ")
        sent += 1
    return sent


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_hostile_paths_headers_and_names_write_no_line_of_their_own(
    log_format: str, tmp_path: Path
) -> None:
    spec = SimReplicaSpec(name="sim-0", port=0, costs=FAST_COSTS, itl_s=0.001)
    async with running_app(create_sim_app(spec)) as replica:
        config = tmp_path / "gateway.yaml"
        config.write_text(CONFIG.format(admin=ADMIN_KEY, web=WEB_KEY, model=MODEL, replica=replica))
        args = ["--config", str(config), "--log-format", log_format, "--log-level", "info"]
        async with served([], *args) as (url, lines):
            sent = await hostile_requests(url)
            await asyncio.sleep(0.3)  # the last access line is written after the answer
    assert lines, "no log line"
    if log_format == "json":
        records = [json.loads(line) for line in lines]  # every line is one JSON object
        access = [r for r in records if r["logger"] == "cachelane.access"]
        assert not any(r["msg"].startswith("forged") for r in records)
    else:
        records = [line for line in lines if RECORD_START.match(line)]
        others = [line for line in lines if not RECORD_START.match(line)]
        assert all(line.startswith(TextFormatter.TRACE_INDENT) for line in others), others
        assert all(line.isascii() and line.isprintable() for line in records), records
        access = [line for line in records if " cachelane.access: " in line]
        assert not [line for line in lines if line.startswith("2026-12-04 18:31:00,000")]
    assert len(access) == sent, "\n".join(map(str, access))
