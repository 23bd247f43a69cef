"""Whether an engine takes `priority` is asked, not assumed: a refusal is never the client's, and
`cachelane check-config --probe` asks what the gateway would. Real simulated replicas (fcfs and
priority engines, the answers vLLM gives) and a real gateway on loopback, the `openai` client."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from gateway.cli.main import main
from gateway.config import parse_config
from gateway.fleet import engine_priority
from gateway.http.app import create_app
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from tests.helpers.servers import running_app
from tests.integration.fleet import CLASS_KEYS, MODEL, QUICK_CHECKS, TEST_AUTH_SECRET

WAIT_S = 15.0  # bound on any one request


async def _sim(stack: AsyncExitStack, name: str, policy: str) -> str:
    spec = SimReplicaSpec(name=name, port=0, itl_s=0.001, scheduling_policy=policy)  # type: ignore[arg-type]
    return await stack.enter_async_context(running_app(create_sim_app(spec)))


async def test_a_refusal_of_priority_at_request_time_is_sent_again_without_it() -> None:
    """An engine that took the probe's priority and was then restarted under fcfs: the critical
    request it refuses goes again without `priority` and is answered; the replica is sent none
    from then on, and estimated as the fcfs engine it is."""
    async with AsyncExitStack() as stack:
        url = await _sim(stack, "fcfs-0", "fcfs")
        config = parse_config(
            {
                **QUICK_CHECKS,
                "auth": {"mode": "keys", "secret": TEST_AUTH_SECRET},
                "tenants": [{"name": "voice", "class": "critical", "api_key": CLASS_KEYS["voice"]}],
                "pools": [
                    {"name": "p", "models": [MODEL], "replicas": [url], "engine_priority": True}
                ],
            }
        )
        app = create_app(config)
        gateway = await stack.enter_async_context(running_app(app))
        registry = app.state.gw.registry
        (replica,) = registry.replicas.values()
        for _ in range(int(WAIT_S / 0.05)):  # admitted once its first check (and probe) passed
            if replica.healthy:
                break
            await asyncio.sleep(0.05)
        assert replica.healthy and replica.accepts_priority is False  # the probe asked
        engine_priority.record(replica, True, "test")  # as if it said yes, then restarted
        assert replica.rules.engine_priority

        async with AsyncOpenAI(
            base_url=f"{gateway}/v1", api_key=CLASS_KEYS["voice"], max_retries=0
        ) as client:
            for stream in (False, True):
                engine_priority.record(replica, True, "test")
                answer = await asyncio.wait_for(
                    client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": "hello"}],
                        max_tokens=2,
                        stream=stream,
                    ),
                    WAIT_S,
                )
                if stream:
                    async for _ in answer:  # type: ignore[union-attr]
                        pass
                assert replica.accepts_priority is False
                assert not replica.rules.engine_priority


@pytest.mark.parametrize(("policy", "status"), [("priority", 0), ("fcfs", 1)])
async def test_check_config_probe_asks_each_replica_whether_it_takes_priority(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], policy: str, status: int
) -> None:
    async with AsyncExitStack() as stack:
        url = await _sim(stack, "sim-0", policy)
        path = tmp_path / "gateway.yaml"
        path.write_text(
            "auth: {mode: open}\n"
            f"pools: [{{name: gpu, models: [{MODEL}], engine_priority: true, "
            f"replicas: ['{url}']}}]\n"
        )
        code = await asyncio.to_thread(main, ["check-config", str(path), "--probe"])
    out, err = capsys.readouterr()
    assert code == status
    assert f"{url}: models {MODEL}" in out
    if policy == "fcfs":
        assert "refuses `priority`" in out
        assert f"pools.0 ('gpu') sets engine_priority but {url} refuses" in err
    else:
        assert "takes `priority`" in out and "warning" not in err
