"""schemathesis against the gateway's own OpenAPI schema: requests generated from
/openapi.json, the chat and completions bodies included (gateway/http/openapi.py), sent to a running
gateway in front of a simulated replica; none may be answered 5xx (schemathesis's
not_a_server_error check), and the gateway keeps serving.

Bounded: a fixed number of examples per operation and a deadline per example. Hypothesis runs in a
worker thread with schemathesis's blocking client, so the gateway (served by this event loop)
answers meanwhile."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from gateway.http.app import create_app
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from tests.helpers.servers import running_app
from tests.integration.fleet import FAST_COSTS, MODEL, gateway_config
from tests.integration.test_input import errors_by_code

pytestmark = pytest.mark.slow  # `make check` leaves it out: requests from the OpenAPI schema

KEY = "web-key-schemathesis-0123456789abcdef012"
ADMIN_KEY = "admin-key-schemathesis-0123456789abcdef0"  # for /admin and /debug
EXAMPLES = {"POST /v1/chat/completions": 80, "POST /v1/completions": 80}
OTHER_EXAMPLES = 10  # every other operation (models, health, admin, debug views...)
SIM_ITL_S = 0.00001  # the replica decodes at once
MAX_TOKENS = 64  # generated token limits capped: a billion tokens would decode for hours


def settings_for(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=timedelta(seconds=10),
        database=None,  # nothing written to .hypothesis/ in the work tree
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


def prepared(case: Any, admin: bool) -> dict[str, str]:
    """The case's headers with a real key (the admin's for /admin and /debug) in place of the
    token schemathesis makes up for the bearer scheme; a served model and bounded token limits
    in its body."""
    headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
    headers["authorization"] = f"Bearer {ADMIN_KEY if admin else KEY}"
    if isinstance(case.body, dict):
        if "model" in case.body:
            case.body["model"] = MODEL  # a made-up model stops at the first check (404)
        for limit in ("max_tokens", "max_completion_tokens"):  # the replica decodes them
            value = case.body.get(limit)
            if isinstance(value, int):
                case.body[limit] = min(value, MAX_TOKENS)
    return headers


def run_operation(url: str, operation: Any) -> Counter[int]:
    """One operation's bounded hypothesis run; the statuses it was answered with."""
    statuses: Counter[int] = Counter()
    admin = operation.path.startswith(("/admin", "/debug"))

    @settings_for(EXAMPLES.get(operation.label, OTHER_EXAMPLES))
    @given(case=operation.as_strategy())
    def no_5xx(case: Any) -> None:
        response = case.call(base_url=url, headers=prepared(case, admin), timeout=10)
        statuses[response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error])

    no_5xx()
    return statuses


def run_schemathesis(url: str) -> dict[str, Counter[int]]:
    """Every operation of the served schema."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    ran = {}
    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]  # raises on an invalid operation
        ran[operation.label] = run_operation(url, operation)
    return ran


async def test_schemathesis_finds_no_5xx() -> None:
    spec = SimReplicaSpec(name="sim-0", port=0, costs=FAST_COSTS, itl_s=SIM_ITL_S)
    async with running_app(create_sim_app(spec)) as replica:
        config = gateway_config(
            [replica],
            tenants=[{"name": "web", "api_key": KEY}],
            admin={"api_key": ADMIN_KEY},
            exposure={"docs": True},
            rate_limits={"failed_auth_per_min": 0},  # generated headers may replace the key
        )
        async with running_app(create_app(config)) as url:
            ran = await asyncio.to_thread(run_schemathesis, url)
            for label in EXAMPLES:  # the bodies reached the replica, not only the checks
                assert ran[label][200] > 0, ran
            async with httpx.AsyncClient(base_url=url, timeout=10) as h:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                auth = {"authorization": f"Bearer {KEY}"}
                assert (await h.post("/v1/chat/completions", json=body, headers=auth)).is_success
                errors = errors_by_code((await h.get("/metrics")).text)
            assert "internal_error" not in errors, errors
