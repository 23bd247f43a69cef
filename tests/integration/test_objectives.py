"""TTFT objectives and a pinned pool with nothing but `pinned: true`, end to end: real simulated
replicas (SLOW: 10k prefill tokens/s) and a real gateway on loopback, the `openai` client and
httpx. A long prefill (BUSY_TOKENS, 3 s) makes a replica's queue deterministic for the time a
test needs it; every wait is bounded and nothing asserts on speed.
"""

from __future__ import annotations

import asyncio
import time

import httpx
from openai import AsyncOpenAI

from tests.integration.fleet import MODEL
from tests.integration.test_flow_control import (
    KEYS,
    WAIT_S,
    SimPool,
    auth,
    body,
    in_flight,
    metric,
    open_stream,
    prompt,
    sim_fleet,
    until,
)

BUSY_TOKENS = 30_000  # 3 s of prefill at 10k tokens/s
SLO_HEADER = "x-slo-ttft-ms"


async def streamed(url: str, tenant: str, tag: str, slo_ms: str | None = None) -> dict[str, str]:
    """One streamed request with the openai client, read to its end: its response headers."""
    extra = {SLO_HEADER: slo_ms} if slo_ms is not None else None
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS[tenant], max_retries=0) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=prompt(tag, 200),
            max_tokens=2,
            stream=True,
            extra_headers=extra,
        )
        async for _ in raw.parse():
            pass
    return dict(raw.headers)


async def test_an_invalid_objective_is_a_400_naming_the_header() -> None:
    async with (
        sim_fleet([SimPool("shared")]) as f,
        httpx.AsyncClient(base_url=f.gateway_url, timeout=WAIT_S) as h,
    ):
        for bad in ("soon", "0", "-1", "nan"):
            r = await h.post(
                "/v1/chat/completions",
                json=body(prompt("x", 100)),
                headers={**auth("web"), SLO_HEADER: bad},
            )
            assert r.status_code == 400, bad
            err = r.json()["error"]
            assert (err["param"], err["type"]) == (SLO_HEADER, "invalid_request_error")


async def test_objectives_shed_batch_with_retry_after_place_and_count_attainment() -> None:
    """Two replicas, one busy with a 3 s prefill. A standard request with an objective goes to
    the idle one and meets it; a batch request whose class objective (200 ms) no replica can
    meet without delaying the other's work is shed with Retry-After; with its own, longer
    objective it is served."""
    classes = {"batch": {"ttft_slo_ms": 200}}
    async with (
        sim_fleet([SimPool("shared", 2)], classes=classes) as f,
        httpx.AsyncClient(base_url=f.gateway_url, timeout=WAIT_S) as h,
    ):
        a, b = f.pools["shared"]
        busy = await open_stream(h, "web", prompt("busy", BUSY_TOKENS), first_token=False)
        await until(lambda: in_flight(f, a) + in_flight(f, b) == 1, "the long prefill")
        idle = b if in_flight(f, a) else a

        placed = await asyncio.wait_for(streamed(f.gateway_url, "acme", "placed", "2000"), WAIT_S)
        assert placed["x-cachelane-replica"] == idle
        assert float(placed["x-cachelane-est-ttft-ms"]) <= 2000

        # both replicas busy now: the idle one with a second long prefill
        busy2 = await open_stream(h, "web", prompt("busy2", BUSY_TOKENS), first_token=False)
        await until(lambda: in_flight(f, a) == 1 and in_flight(f, b) == 1, "both busy")
        shed = await h.post(
            "/v1/chat/completions", json=body(prompt("b1", 200)), headers=auth("bulk")
        )
        assert shed.status_code == 503
        assert shed.json()["error"]["code"] == "overloaded"
        assert int(shed.headers["retry-after"]) >= 1

        served = await asyncio.wait_for(streamed(f.gateway_url, "bulk", "b2", "10000"), WAIT_S)
        assert served["x-cachelane-replica"] in {a, b}
        await busy.aclose()
        await busy2.aclose()
        text = (await h.get("/metrics")).text
    attained = "cachelane_slo_attained_total"
    assert metric(text, attained, **{"class": "standard", "tenant": "acme", "outcome": "met"}) == 1
    assert metric(text, attained, **{"class": "batch", "tenant": "bulk", "outcome": "shed"}) == 1
    assert metric(text, attained, **{"class": "batch", "tenant": "bulk", "outcome": "met"}) == 1
    assert metric(text, "cachelane_shed_total", tenant_class="batch") == 1


async def test_a_pinned_pool_with_default_knobs_is_lent_and_spills_critical_by_cost() -> None:
    """One pinned replica (`pinned: true`, nothing else) and one shared. Standard traffic uses
    both while no critical request needs the pinned one; a critical request that finds the
    pinned replica busy with a long prefill goes to the idle shared one (a spill). Lending goes
    on: the cost model sees what waits on the pinned replica."""
    pinned, shared = SimPool("pinned", config={"pinned": True}), SimPool("shared")
    async with (
        sim_fleet([pinned, shared]) as f,
        httpx.AsyncClient(base_url=f.gateway_url, timeout=WAIT_S) as h,
    ):
        (p,), (s,) = f.pools["pinned"], f.pools["shared"]
        ready = (await h.get("/ready")).json()
        assert ready["pinned_pool"] == {"undersized": False, "hint": None}

        # lending: two long standard prefills take both replicas, the pinned one included
        first = await open_stream(h, "web", prompt("s1", BUSY_TOKENS), first_token=False)
        await until(lambda: in_flight(f, p) + in_flight(f, s) == 1, "the first prefill")
        second = await open_stream(h, "acme", prompt("s2", BUSY_TOKENS), first_token=False)
        await until(lambda: in_flight(f, p) == 1 and in_flight(f, s) == 1, "one on each")
        await first.aclose()
        await second.aclose()
        await until(lambda: in_flight(f, p) + in_flight(f, s) == 0, "an idle fleet")

        # spill: the pinned replica busy with a critical prefill, a second critical request
        # goes to the idle shared replica
        c1 = await open_stream(h, "voice", prompt("c1", BUSY_TOKENS), first_token=False)
        await until(lambda: in_flight(f, p) == 1, "the critical prefill on the pinned replica")
        spilled = await asyncio.wait_for(streamed(f.gateway_url, "voice", "c2"), WAIT_S)
        assert spilled["x-cachelane-replica"] == s
        assert spilled["x-cachelane-fallback"] == "spill"
        assert not f.gw.planner.pinned.reclaimed(time.monotonic())
        await c1.aclose()
        text = (await h.get("/metrics")).text
    assert metric(text, "cachelane_critical_routed_total", where="spilled") == 1
    assert metric(text, "cachelane_critical_fallbacks_total", action="spill") == 1
