"""The gateway's side of TTFT objectives and the pinned pool's watch: the x-slo-ttft-ms header
(gateway/serving/request_input.py), the planner's shed (gateway/serving/planner.py), attainment
(gateway/serving/slo.py), and the undersized-pool hint (gateway/serving/pinning.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import PoolConfig
from gateway.http.errors import ApiError
from gateway.serving import slo
from gateway.serving.pinning import MIN_REQUESTS, REPORT_WINDOW_S, PinnedPoolWatch
from gateway.serving.request_input import TTFT_SLO_HEADER, ttft_slo_of
from gateway.telemetry.metrics import Metrics
from gateway.tenancy.tenants import Tenant
from routing.types import TenantClass
from tests.unit.test_planner import SHARED, chat, config, pool, setup

BATCH = Tenant("nightly", TenantClass.BATCH)


@pytest.mark.parametrize(
    ("value", "ms"),
    [(None, None), ("250", 250.0), (" 1.5 ", 1.5), ("600000", 600_000.0)],
    ids=["absent", "integer", "fraction-spaces", "largest"],
)
def test_a_valid_objective_header(value: str | None, ms: float | None) -> None:
    headers = {} if value is None else {TTFT_SLO_HEADER: value}
    assert ttft_slo_of(headers) == ms


@pytest.mark.parametrize(
    "value",
    ["", "fast", "0", "-5", "nan", "inf", "600001", "1e309"],
    ids=["empty", "word", "zero", "negative", "nan", "inf", "too-large", "overflow"],
)
def test_an_invalid_objective_header_is_a_400_naming_it(value: str) -> None:
    with pytest.raises(ApiError) as caught:
        ttft_slo_of({TTFT_SLO_HEADER: value})
    err = caught.value
    assert err.status == 400
    assert err.param == TTFT_SLO_HEADER
    assert err.envelope()["error"]["type"] == "invalid_request_error"


def attained(metrics: Metrics, tenant: Tenant, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "cachelane_slo_attained_total",
        {"class": tenant.tenant_class.value, "tenant": tenant.name, "outcome": outcome},
    )
    return value or 0.0


async def test_a_batch_request_that_cannot_meet_its_objective_is_shed_with_retry_after() -> None:
    s = await setup(config(pool("shared", SHARED)))
    for name in s.names(SHARED):  # ~3 s of prefill queued everywhere (100k tokens/s)
        s.registry.reserve(s.registry.replicas[name], prefill_tokens=300_000, swaps=0)
    with pytest.raises(ApiError) as caught:
        await s.planner.plan("chat", chat(), BATCH, headers={TTFT_SLO_HEADER: "500"})
    err = caught.value
    assert (err.status, err.code) == (503, "overloaded")
    assert int(err.headers["retry-after"]) >= 3
    assert attained(s.metrics, BATCH, "shed") == 1
    # a dry run (/debug/route) answers the same and counts nothing
    with pytest.raises(ApiError):
        await s.planner.plan("chat", chat(), BATCH, dry_run=True, headers={TTFT_SLO_HEADER: "500"})
    assert attained(s.metrics, BATCH, "shed") == 1


async def test_the_class_default_objective_is_the_plans() -> None:
    classes: dict[str, Any] = {"batch": {"ttft_slo_ms": 4000}}
    s = await setup(config(pool("shared", SHARED), classes=classes))
    plan = await s.planner.plan("chat", chat(), BATCH)
    assert plan.ttft_objective_ms == 4000
    own = await s.planner.plan("chat", chat(), BATCH, headers={TTFT_SLO_HEADER: "900"})
    assert own.ttft_objective_ms == 900
    standard = await s.planner.plan("chat", chat(), Tenant("acme", TenantClass.STANDARD))
    assert standard.ttft_objective_ms is None


@pytest.mark.parametrize(
    ("stream", "in_gateway_s", "ttft_s", "outcome"),
    [
        (True, 0.1, 0.3, "met"),
        (True, 0.3, 0.3, "missed"),  # the client's TTFT counts the time in the gateway
        (False, 0.0, 0.1, None),  # a whole answer is not judged
    ],
    ids=["met", "missed-in-gateway", "whole-answer"],
)
async def test_attainment_is_judged_on_the_clients_ttft(
    stream: bool, in_gateway_s: float, ttft_s: float, outcome: str | None
) -> None:
    s = await setup(config(pool("shared", SHARED)))
    body = {**chat(), "stream": stream}
    plan = await s.planner.plan(
        "chat", body, BATCH, received_s=100.0, headers={TTFT_SLO_HEADER: "500"}
    )
    slo.observe_first_byte(s.metrics, plan, 100.0 + in_gateway_s, ttft_s)
    for each in ("met", "missed"):
        assert attained(s.metrics, BATCH, each) == (1 if each == outcome else 0)


SHARED_POOL = PoolConfig.model_validate({"name": "shared", "replicas": ["http://127.0.0.1:1"]})
PINNED_POOL = PoolConfig.model_validate(
    {"name": "pinned", "replicas": ["http://127.0.0.1:2"], "pinned": True}
)


@pytest.mark.parametrize(
    ("short", "undersized"), [(0, False), (MIN_REQUESTS // 2, True)], ids=["fits", "too-small"]
)
def test_a_pinned_pool_too_small_for_its_critical_demand_is_reported(
    short: int, undersized: bool
) -> None:
    metrics = Metrics()
    watch = PinnedPoolWatch(metrics)
    for i in range(MIN_REQUESTS):
        pool, pressed = (SHARED_POOL, True) if i < short else (PINNED_POOL, False)
        watch.served(pool, float(i), pressed=pressed, reclaim_s=0.5)
    watch.served(PINNED_POOL, REPORT_WINDOW_S + 1)  # the window closes
    status = watch.status()
    assert status["undersized"] is undersized
    assert (status["hint"] is not None) is undersized
    short_share = metrics.registry.get_sample_value("cachelane_pinned_pool_short_ratio")
    assert short_share == short / MIN_REQUESTS


def test_a_pressed_spill_reclaims_lending_for_its_estimate_only() -> None:
    watch = PinnedPoolWatch(Metrics())
    watch.served(SHARED_POOL, 10.0, pressed=False, reclaim_s=3.0)  # left for its context
    assert not watch.reclaimed(10.1)
    watch.served(SHARED_POOL, 10.0, pressed=True, reclaim_s=0.4)
    assert watch.reclaimed(10.3) and not watch.reclaimed(10.5)
