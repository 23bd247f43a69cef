"""The gateway's lifecycle: its components start in the order of their one list and close in
reverse; a failing start closes those already started (and names the one that failed);
aclose is idempotent and harmless on a component that never started; a built gateway's list
starts and closes for real, leaving no task behind."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx
import pytest

from gateway.components import Background, Component, Resource, loop, start_all
from gateway.config import parse_config
from gateway.serving.flow import ClassLimits, FlowControl
from gateway.wiring import build_gateway
from routing.types import TenantClass

CLOSED_PORT_URL = "http://127.0.0.1:9"  # discard port: nothing listens, so checks fail at once


def recorded(name: str, events: list[str], *, fails: bool = False) -> Resource:
    """A resource that writes what happens to it into `events`."""

    async def opened() -> None:
        events.append(f"start {name}")
        if fails:
            raise RuntimeError(f"{name} cannot start")

    async def closed() -> None:
        events.append(f"close {name}")

    return Resource(name, opened=opened, closed=closed)


async def test_components_start_in_order_and_close_in_reverse() -> None:
    events: list[str] = []
    parts: list[Component] = [recorded(n, events) for n in ("redis", "index", "health")]
    async with contextlib.AsyncExitStack() as stack:
        await start_all(parts, stack)
        assert events == ["start redis", "start index", "start health"]
    assert events[3:] == ["close health", "close index", "close redis"]


async def test_a_failing_start_closes_those_already_started(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events: list[str] = []
    parts: list[Component] = [
        recorded("redis", events),
        recorded("tenants", events, fails=True),
        recorded("scraper", events),
    ]
    with caplog.at_level(logging.ERROR, "cachelane.components"), pytest.raises(RuntimeError):
        async with contextlib.AsyncExitStack() as stack:
            await start_all(parts, stack)
    # the half-started one is closed too; the one after it never started
    assert events == ["start redis", "start tenants", "close tenants", "close redis"]
    assert "component tenants failed to start" in caplog.text


async def test_a_failing_close_does_not_keep_the_others_open(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events: list[str] = []

    async def refuses() -> None:
        raise OSError("already gone")

    parts: list[Component] = [recorded("redis", events), Resource("index", closed=refuses)]
    with caplog.at_level(logging.ERROR, "cachelane.components"):
        async with contextlib.AsyncExitStack() as stack:
            await start_all(parts, stack)
    assert events == ["start redis", "close redis"]
    assert "component index failed to close" in caplog.text


def flow_control() -> FlowControl:
    return FlowControl({c: ClassLimits(10, 5.0) for c in TenantClass})


async def test_a_loop_owns_its_task_and_aclose_is_idempotent() -> None:
    component = loop("flow-control", flow_control().run)
    await component.start()
    (task,) = [t for t in asyncio.all_tasks() if t.get_name() == "flow-control"]
    assert not task.done()
    await component.aclose()
    assert task.cancelled()
    await component.aclose()  # again: nothing to do, nothing raised


async def test_a_background_part_is_finished_once_after_its_tasks() -> None:
    events: list[str] = []
    flow = flow_control()

    async def finish() -> None:
        events.append("finished")

    component = Background("feeds", lambda: [asyncio.create_task(flow.run())], finish=finish)
    await component.start()
    await component.aclose()
    await component.aclose()
    assert events == ["finished"]


async def test_a_component_that_never_started_closes_quietly() -> None:
    events: list[str] = []
    for component in (recorded("redis", events), loop("flow-control", flow_control().run)):
        await component.aclose()
        await component.aclose()
    assert events == []  # nothing was opened, so nothing is closed


async def test_a_built_gateway_starts_and_closes_its_list() -> None:
    config = parse_config(
        {
            "flow_control": {"enabled": True},
            "prewarm": {"enabled": True},
            "pools": [{"name": "p", "replicas": [CLOSED_PORT_URL], "models": ["m"]}],
        }
    )
    before = asyncio.all_tasks()
    async with httpx.AsyncClient(timeout=1.0, trust_env=False) as client:
        gw = build_gateway(config, client)
        names = [c.name for c in gw.components]
        assert names == [
            "upstream",  # made by the gateway (the client was given: the caller closes it)
            "index",
            "responses",
            "rate-limits",
            "gc-pauses",
            "fleet",
            "discovery",
            "health-checks",
            "tenant-refresh",
            "prewarm",
            "flow-control",
            "engine-metrics",
        ]
        async with contextlib.AsyncExitStack() as stack:
            await start_all(gw.components, stack)
            (replica,) = gw.registry.replicas.values()
            assert not replica.healthy and replica.last_error is not None  # checked at start
        assert asyncio.all_tasks() - before <= {asyncio.current_task()}
