"""Cost accounting on a real fleet: a uvicorn gateway in front of simulated replicas with CPU
tiers and a shared remote tier (all on loopback), a seeded three-tenant trace, and the gateway's
GET /debug/costs sums against the simulator's own counters; the endpoint's admin guard; the
cachelane_cost_* metrics; `cachelane report` in a subprocess against the live gateway."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import parse_config
from gateway.http.app import create_app
from loadtest.bench.costs import (
    ADMIN_KEY,
    TENANT_KEYS,
    FleetShape,
    Outcome,
    checks,
    debug_costs,
    gateway_totals,
    scrape_sums,
    send_trace,
)
from loadtest.sim.config import RemoteTierSpec, SimReplicaSpec
from loadtest.sim.remote import create_remote_app
from loadtest.sim.server import create_sim_app
from loadtest.workloads.cost_traces import cost_trace
from routing.cost import PoolCosts
from tests.helpers.servers import running_app

pytestmark = pytest.mark.slow  # `make check` leaves it out: simulated fleets

REQUESTS = 60  # ~8 s at 8 req/s: enough for every tier to fill and evict (FleetShape's sizes)
RATE_PER_S = 8.0
REPORT_TIMEOUT_S = 60.0  # a Python start-up and two HTTP calls on a loaded 2-core machine


@dataclass
class CostFleet:
    gateway_url: str
    replica_urls: list[str]
    remote_url: str


@asynccontextmanager
async def cost_fleet(shape: FleetShape) -> AsyncIterator[CostFleet]:
    """The bench's fleet in-process: the sims are built with the capacities the gateway's
    config states, as `cachelane sim --config` would."""
    async with AsyncExitStack() as stack:
        remote = create_remote_app(
            RemoteTierSpec(name="kv", port=0, capacity_tokens=shape.remote_capacity_tokens)
        )
        remote_url = await stack.enter_async_context(running_app(remote))
        urls = []
        for i in range(shape.replicas):
            spec = SimReplicaSpec(
                name=f"offload-{i}",
                port=0,
                hbm_capacity_tokens=shape.hbm_capacity_tokens,
                cpu_capacity_tokens=shape.cpu_capacity_tokens,
                remote_url=remote_url,
                costs=PoolCosts(pcie_gbps=shape.pcie_gbps),
                itl_s=shape.itl_s,
            )
            urls.append(await stack.enter_async_context(running_app(create_sim_app(spec))))
        app = create_app(parse_config(shape.config(urls, remote_url)))
        gateway_url = await stack.enter_async_context(running_app(app))
        yield CostFleet(gateway_url, urls, remote_url)


async def run_trace(fleet: CostFleet) -> list[Outcome]:
    trace = cost_trace(REQUESTS, RATE_PER_S, seed=1)
    outcomes = await send_trace(trace, fleet.gateway_url, TENANT_KEYS, max_in_flight=16)
    assert all(o.status == 200 and o.error is None for o in outcomes), [
        o.error for o in outcomes if o.error
    ][:3]
    await asyncio.sleep(0.3)  # the last remote writes run beside the last answers
    return outcomes


def within(gateway: float, simulator: float, tolerance: float) -> bool:
    return abs(gateway - simulator) <= tolerance * max(simulator, 1.0)


@pytest.mark.timeout(90)
async def test_accounting_matches_the_simulators_counters() -> None:
    async with cost_fleet(FleetShape()) as fleet:
        outcomes = await run_trace(fleet)
        async with httpx.AsyncClient(timeout=10.0) as client:
            window = await debug_costs(client, fleet.gateway_url)
            replicas = await scrape_sums(client, fleet.replica_urls)
            remote = await scrape_sums(client, [fleet.remote_url])
    gw = gateway_totals(window)
    by_name = {c.quantity: c for c in checks(gw, replicas, remote, outcomes)}

    # What the engine reports in its usage is exact.
    for name in ("streamed requests", "prompt tokens", "cached tokens"):
        c = by_name[name]
        assert c.gateway == c.simulator, c
    # The split by tier is the decision's, corrected by the engine's cached tokens: a prefix
    # another request prefilled meanwhile is found in HBM rather than where the index said, so
    # the split moves by a few percent between tiers while the total stays exact.
    assert within(by_name["HBM-hit tokens"].gateway, by_name["HBM-hit tokens"].simulator, 0.10)
    loaded_gw = gw["cpu_tokens"] + gw["remote_tokens"]
    loaded_sim = by_name["CPU-tier tokens (PCIe)"].simulator
    loaded_sim += by_name["remote-tier tokens fetched"].simulator
    assert within(loaded_gw, loaded_sim, 0.15), (loaded_gw, loaded_sim)
    # Swap-ins are 6-12 a run: one request the gateway's HBM LRU and the sim's disagree on (they
    # evict a swap's length apart: the index records a computed tail at send and loaded blocks at
    # the first byte, the sim all of them when the request is first scheduled) is 8-17%. Measured
    # over 12 runs of this trace (diagnosis in the commit): at most one apart, CPU tokens within 3%.
    swaps = by_name["swap-ins"]
    assert abs(swaps.gateway - swaps.simulator) <= max(1.0, 0.15 * swaps.simulator), swaps
    assert gw["pcie_bytes"] == gw["cpu_tokens"] * PoolCosts().kv_bytes_per_token
    # The remote ledger and the HBM index mirror LRUs the sims keep at the same capacities.
    for name in ("remote bytes written", "remote bytes evicted", "HBM blocks evicted"):
        c = by_name[name]
        assert c.simulator > 0, f"{name}: the run did not exercise it"
        assert within(c.gateway, c.simulator, 0.05), c
    never = by_name["remote bytes evicted never read"]
    assert never.simulator > 0 and within(never.gateway, never.simulator, 0.15), never
    # The layers of every streamed request sum to its observed TTFT.
    layers = sum(gw[f"{layer}_s"] for layer in ("fixed", "queue", "swap", "fetch", "prefill"))
    assert layers == pytest.approx(gw["observed_ttft_s"], rel=1e-6)
    # Per tenant: bulk's one-off prompts are the remote tier's unread writes.
    rows = {r["tenant"]: r["sums"] for r in window["rows"]}
    assert rows["bulk"]["remote_never_read_bytes"] > rows["agents"]["remote_never_read_bytes"]
    assert rows["bulk"]["cached_tokens"] == 0 and rows["agents"]["cached_tokens"] > 0


async def metric_sums(client: httpx.AsyncClient, url: str, family: str) -> dict[str, float]:
    text = (await client.get(f"{url}/metrics")).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            for s in fam.samples:
                if s.name.endswith("_total"):
                    key = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                    out[key] = s.value
    return out


@pytest.mark.timeout(90)
async def test_debug_costs_metrics_and_report() -> None:
    async with cost_fleet(FleetShape()) as fleet:
        await run_trace(fleet)
        url = fleet.gateway_url
        async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
            # admin-authenticated, like /admin
            assert (await client.get("/debug/costs")).status_code == 401
            tenant = {"authorization": f"Bearer {TENANT_KEYS['agents']}"}
            denied = await client.get("/debug/costs", headers=tenant)
            assert denied.status_code == 401
            assert denied.json()["error"]["code"] == "invalid_api_key"
            admin = {"authorization": f"Bearer {ADMIN_KEY}"}
            for bad in ("0", "abc", "7200"):
                resp = await client.get("/debug/costs", params={"window_s": bad}, headers=admin)
                assert resp.status_code == 400 and resp.json()["error"]["param"] == "window_s"
            every = (await client.get("/debug/costs", headers=admin)).json()
            assert [w["window_s"] for w in every["windows"]] == [60.0, 900.0, 3600.0]
            hour = every["windows"][2]
            assert {r["tenant"] for r in hour["rows"]} == {"agents", "bulk", "voice"}
            assert hour["remote_tiers"][0]["name"] == "kv"
            # the metrics say what the accounting says
            ttft = await metric_sums(client, url, "cachelane_cost_ttft_seconds")
            observed = sum(r["sums"]["observed_ttft_s"] for r in hour["rows"])
            assert sum(ttft.values()) == pytest.approx(observed, rel=1e-6)
            assert {k.split(",")[0] for k in ttft} == {
                f"layer={x}" for x in ("fixed", "queue", "swap", "fetch", "prefill")
            }
            written = await metric_sums(client, url, "cachelane_cost_remote_bytes")
            bulk_written = written["kind=written,pool=offload,tenant=bulk,tenant_class=batch"]
            bulk_row = next(r for r in hour["rows"] if r["tenant"] == "bulk")
            assert bulk_written == bulk_row["sums"]["remote_written_bytes"]

        # `cachelane report`, a separate process, against the live gateway (twice: merged)
        text = await cli("report", url, "--admin-key", ADMIN_KEY, "--window", "15m")
        assert "Where the cost of offloading landed" in text
        assert "remote tier:" in text and "were evicted without ever being read" in text
        assert "tenant bulk's prompts are" in text
        assert "cache hits avoided" in text
        one = json.loads(await cli("report", url, "--admin-key", ADMIN_KEY, "--json"))
        two = json.loads(await cli("report", url, url, "--admin-key", ADMIN_KEY, "--json"))
        requests = {r["tenant"]: r["sums"]["requests"] for r in one["rows"]}
        assert {r["tenant"]: r["sums"]["requests"] for r in two["rows"]} == {
            t: 2 * n for t, n in requests.items()
        }
        failed = await cli("report", url, "--admin-key", "wrong-key", check=False)
        assert "401" in failed and "invalid or missing admin key" in failed


async def cli(*args: str, check: bool = True) -> str:
    """`python -m gateway ARGS` without blocking the event loop the servers run in."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), REPORT_TIMEOUT_S)
    text = out.decode() + err.decode()
    if check:
        assert proc.returncode == 0, text
    else:
        assert proc.returncode != 0, text
    return text
