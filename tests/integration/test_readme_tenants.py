"""The README's tenant set-up, run as it is written: deploy/examples/sim-tenants.yaml simulated by
`cachelane sim --config` (its replicas on free loopback ports instead of 9001-9004) and served by
the gateway; a critical and a standard tenant are answered through the `openai` client, and the
README's route explanation and report run against it with its admin key."""

from __future__ import annotations

import asyncio
import secrets
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from gateway.cli.main import main
from gateway.config import load_config
from gateway.http.app import create_app
from loadtest.sim.from_config import specs_from_config
from loadtest.sim.server import create_sim_app
from tests.helpers.ports import free_port
from tests.helpers.servers import running_app

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "sim-tenants.yaml"
README = EXAMPLE.parents[2] / "README.md"
WAIT_S = 15.0  # bound on any one wait


def test_the_readme_points_at_the_example() -> None:
    text = README.read_text()
    assert "cachelane sim --config deploy/examples/sim-tenants.yaml" in text
    assert "cachelane serve --config deploy/examples/sim-tenants.yaml" in text


async def test_the_readme_tenants_are_served_on_the_simulator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {name: secrets.token_hex(32) for name in ("VOICE_KEY", "WEB_KEY", "ADMIN_KEY")}
    text = EXAMPLE.read_text()
    for port in range(9001, 9005):
        text = text.replace(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{free_port()}")
    path = tmp_path / "sim-tenants.yaml"
    path.write_text(text)
    config = load_config(path, env=env)
    specs, remote = specs_from_config(config)  # what `cachelane sim --config` runs
    assert remote is None and len(specs) == 4
    assert {s.scheduling_policy for s in specs} == {"priority"}  # the pool's, engine_priority
    async with AsyncExitStack() as stack:
        for spec in specs:
            await stack.enter_async_context(running_app(create_sim_app(spec), port=spec.port))
        app = create_app(config)
        gateway = await stack.enter_async_context(running_app(app))
        for key in ("VOICE_KEY", "WEB_KEY"):
            async with AsyncOpenAI(
                base_url=f"{gateway}/v1", api_key=env[key], max_retries=0
            ) as client:
                raw = await asyncio.wait_for(
                    client.chat.completions.with_raw_response.create(
                        model="sim-llama-8b",
                        messages=[{"role": "user", "content": "Hi"}],
                        max_tokens=2,
                    ),
                    WAIT_S,
                )
            assert raw.parse().choices
        assert raw.headers["x-cachelane-tenant-class"] == "standard"
        async with httpx.AsyncClient(base_url=gateway, timeout=WAIT_S) as h:
            ready = (await h.get("/ready")).json()
        assert "warnings" not in ready
        assert {r["priority"] for r in ready["replicas"].values()} == {"accepted"}
        # the README's route explanation and report, with the admin key it exported
        explain = ["route-explain", "--gateway", gateway, "--prompt", "What is a KV cache?"]
        code = await asyncio.to_thread(main, [*explain, "--admin-key", env["ADMIN_KEY"]])
        assert code == 0 and "cache_aware -> " in capsys.readouterr().out
        code = await asyncio.to_thread(main, ["report", gateway, "--admin-key", env["ADMIN_KEY"]])
        assert code == 0 and "Where the cost of offloading landed" in capsys.readouterr().out
