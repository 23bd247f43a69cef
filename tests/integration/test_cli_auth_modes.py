"""`cachelane report` and `cachelane route-explain` against live gateways in each auth mode:
open (the quick start: no key at all), keys with an admin key (the admin key alone, no --model),
and keys without one (the message says what to change). Real simulated replicas and gateways on
loopback; the CLI runs in a thread while the servers run in the test's loop."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.cli.main import main
from tests.integration.fleet import CLASS_KEYS, MODEL, fleet

ADMIN_KEY = "admin-key-12-0123456789abcdef0123456789"
TENANTS = [{"name": "web", "class": "standard", "api_key": CLASS_KEYS["web"]}]
WAIT_S = 15.0  # bound on any one request


async def _one_request(url: str, key: str | None = None) -> None:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with httpx.AsyncClient(timeout=WAIT_S) as h:
        resp = await h.post(f"{url}/v1/chat/completions", json=body, headers=headers)
    assert resp.status_code == 200, resp.text


async def test_open_mode_needs_no_key_for_a_report_or_an_explanation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with fleet(2) as f:  # auth.mode open, as `cachelane serve --replicas` runs
        await _one_request(f.gateway_url)
        code = await asyncio.to_thread(main, ["report", f.gateway_url])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert "Where the cost of offloading landed" in out
        code = await asyncio.to_thread(
            main, ["route-explain", "--gateway", f.gateway_url, "--prompt", "What is a KV cache?"]
        )
        out, err = capsys.readouterr()
        assert code == 0, err
        assert "cache_aware -> " in out


async def test_a_keyed_gateway_explains_and_reports_with_the_admin_key_alone(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with fleet(2, tenants=TENANTS, admin={"api_key": ADMIN_KEY}) as f:
        await _one_request(f.gateway_url, CLASS_KEYS["web"])
        explain = ["route-explain", "--gateway", f.gateway_url, "--prompt", "What is a KV cache?"]
        code = await asyncio.to_thread(main, [*explain, "--admin-key", ADMIN_KEY])  # no --model
        out, err = capsys.readouterr()
        assert code == 0, err
        assert "cache_aware -> " in out
        code = await asyncio.to_thread(main, explain)
        _, err = capsys.readouterr()
        assert code == 1 and "give --admin-key" in err

        code = await asyncio.to_thread(main, ["report", f.gateway_url, "--admin-key", ADMIN_KEY])
        out, err = capsys.readouterr()
        assert code == 0, err
        code = await asyncio.to_thread(main, ["report", f.gateway_url])
        _, err = capsys.readouterr()
        assert code == 1
        assert "give --admin-key or set CACHELANE_ADMIN_KEY to its admin key" in err


async def test_a_gateway_without_an_admin_key_says_what_to_set(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with fleet(1, tenants=TENANTS) as f:
        code = await asyncio.to_thread(main, ["report", f.gateway_url, "--admin-key", ADMIN_KEY])
        _, err = capsys.readouterr()
        assert code == 1
        assert "set admin.api_key" in err and "auth.mode open" in err
        code = await asyncio.to_thread(
            main,
            [
                "route-explain",
                "--gateway",
                f.gateway_url,
                "--admin-key",
                ADMIN_KEY,
                "--model",
                MODEL,
            ],
        )
        _, err = capsys.readouterr()
        assert code == 1 and "set admin.api_key in its config" in err
