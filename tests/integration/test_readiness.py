"""What the Kubernetes probes see (deploy/README.md: readiness) during a fleet-wide replica
outage: /health, the readiness and liveness path, answers 200, so the Service keeps the gateway;
clients then get the gateway's JSON 503 with Retry-After instead of the load balancer's error.
/ready says 503 with the replicas' state, for people and alerts."""

from __future__ import annotations

import logging

import httpx
import pytest

from gateway.http.app import create_app
from tests.helpers.ports import free_port
from tests.helpers.servers import running_app
from tests.integration.fleet import MODEL, gateway_config


async def test_with_no_replica_healthy_the_gateway_stays_ready_and_answers_json_503() -> None:
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    app = create_app(gateway_config([down]))
    async with running_app(app) as url, httpx.AsyncClient(base_url=url, trust_env=False) as h:
        assert (await h.get("/health")).status_code == 200
        ready = await h.get("/ready")
        assert ready.status_code == 503 and ready.json()["ready"] is False
        resp = await h.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert resp.status_code == 503
        assert int(resp.headers["retry-after"]) >= 1
        assert resp.json()["error"]["code"]


async def test_a_gateway_without_a_tenant_says_at_start_that_it_serves_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="cachelane")
    down = f"http://127.0.0.1:{free_port()}"
    app = create_app(gateway_config([down], auth={"mode": "keys"}))
    async with running_app(app) as url, httpx.AsyncClient(base_url=url, trust_env=False) as h:
        assert (await h.get("/v1/models")).status_code == 401
    assert any("no request can be served" in m for m in caplog.messages)
