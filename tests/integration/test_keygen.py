"""`cachelane keygen`: the key it prints works against a gateway whose config holds the entry it
prints (a tenant's and the admin's), with the real `openai` client and httpx on loopback."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from gateway.cli.main import main
from gateway.config import load_config
from gateway.http.app import create_app
from tests.helpers.servers import running_app
from tests.integration.fleet import MODEL, QUICK_CHECKS, TEST_AUTH_SECRET, fleet

WAIT_S = 15.0  # bound on any one request


def keygen(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, str]:
    """The key and the config entry `cachelane keygen ARGS` prints."""
    assert main(["keygen", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    key, entry = lines[1], "\n".join(lines[3:])
    assert not lines[0].startswith(key[:8]) and key not in entry
    return key, entry


async def test_the_printed_key_opens_the_gateway_the_entry_configures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    voice_key, voice_entry = keygen(capsys, "voice", "--class", "critical", "--share-group", "rt")
    admin_key, admin_entry = keygen(capsys, "--admin")
    async with fleet(1) as f:  # a replica to serve from (its own gateway is not used)
        path = tmp_path / "gateway.yaml"
        path.write_text(
            f"{voice_entry}\n{admin_entry}\n"
            f"auth: {{secret: {TEST_AUTH_SECRET}}}\n"
            f"health: {QUICK_CHECKS['health']}\n"
            f"pools: [{{name: p, models: [{MODEL}], replicas: ['{f.replica_urls[0]}']}}]\n"
        )
        config = load_config(path)
        assert config.tenants[0].share_group == "rt"
        async with running_app(create_app(config)) as url:
            async with AsyncOpenAI(base_url=f"{url}/v1", api_key=voice_key, max_retries=0) as c:
                raw = await c.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
                )
            assert raw.headers["x-cachelane-tenant-class"] == "critical"
            async with httpx.AsyncClient(timeout=WAIT_S) as h:
                admin = {"authorization": f"Bearer {admin_key}"}
                listed = (await h.get(f"{url}/admin/tenants", headers=admin)).json()["data"]
    assert [t["name"] for t in listed] == ["voice"]


def test_keygen_refuses_a_bad_name_or_both_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keygen", "bad name"]) == 2
    assert main(["keygen", "voice", "--admin"]) == 2
    assert main(["keygen"]) == 2
    assert "tenant NAME, or --admin" in capsys.readouterr().err
