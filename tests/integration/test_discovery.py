"""Replica discovery from DNS against a real dnsmasq on a loopback port
(gateway/fleet/discovery.py).

A pool names a DNS name instead of URLs; the test changes the name's records while the gateway
runs and checks that the change is applied within two resolutions (counted on the gateway's own
cachelane_discovery_resolutions_total, not timed): a replica that left takes no more requests and
its index entries are gone, one that appeared is serving. `type: A` follows a headless Service's
addresses (simulated replicas on 127.0.0.2-4, one port); `type: SRV` its named port (replicas on
127.0.0.1, a port each).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import DiscoveryConfig, parse_config
from gateway.fleet.discovery import DiscoveryFailed, make_resolver, resolve
from gateway.http.app import create_app
from loadtest.bench.processes import free_port_run
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.server import create_sim_app
from loadtest.sim.tiny_tokenizer import BOS, EOS, write_tiny_tokenizer
from routing.types import Location, Tier
from tests.helpers.dnsmasq import Dnsmasq, DnsmasqMissing
from tests.helpers.ports import free_port
from tests.helpers.servers import running_app
from tests.integration.fleet import FAST_COSTS, MODEL

pytestmark = pytest.mark.slow  # `make check` leaves it out: a DNS server (dnsmasq), fleets

INTERVAL_S = 0.3  # re-resolution interval under test
WAIT_S = 20.0  # bound on every wait (a loaded machine); the assertions count resolutions
POOL = "vllm"


@pytest.fixture
def dnsmasq(tmp_path: Path) -> Iterator[Dnsmasq]:
    try:
        server = Dnsmasq(tmp_path)
    except DnsmasqMissing as err:
        pytest.fail(str(err), pytrace=False)
    try:
        yield server
    finally:
        server.stop()


def discovered_config(discovery: dict[str, Any]) -> Any:
    return parse_config(
        {
            "auth": {"mode": "open"},
            "health": {"interval_s": 0.2, "timeout_s": 0.5, "fail_after": 1},
            "engine_metrics": {"enabled": False},
            "pools": [
                {
                    "name": POOL,
                    "models": [MODEL],
                    "discovery": {"interval_s": INTERVAL_S, **discovery},
                    "costs": {"prefill_tokens_per_s": FAST_COSTS.prefill_tokens_per_s},
                }
            ],
        }
    )


async def sim(stack: AsyncExitStack, host: str, port: int) -> str:
    spec = SimReplicaSpec(
        name=f"{host}:{port}", port=port, host=host, costs=FAST_COSTS, itl_s=0.001
    )
    url = await stack.enter_async_context(running_app(create_sim_app(spec), host=host, port=port))
    return url.removeprefix("http://")


async def metric(url: str, name: str, **labels: str) -> float:
    """A sample of the gateway's /metrics (0 when the series does not exist yet)."""
    async with httpx.AsyncClient() as h:
        text = (await h.get(f"{url}/metrics")).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


async def resolutions(url: str, result: str = "ok") -> float:
    return await metric(url, "cachelane_discovery_resolutions_total", pool=POOL, result=result)


async def until(what: str, check: Callable[[], Any]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def two_more_resolutions(url: str, result: str = "ok") -> None:
    """Until two resolutions have been applied after now: the first may have begun before."""
    start = await resolutions(url, result)

    async def done() -> bool:
        return await resolutions(url, result) >= start + 2

    await until(f"two {result} resolutions", done)


async def send(url: str, n: int, tag: str) -> Counter[str]:
    """`n` chat requests with distinct prompts through the real openai client (no retries);
    returns how many each replica served."""
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    served: Counter[str] = Counter()
    for i in range(n):
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"{tag} {i}: " + "tell me about caches " * 40}],
            max_tokens=4,
        )
        assert raw.parse().choices[0].message.content is not None
        served[raw.headers["x-cachelane-replica"]] += 1
    await client.close()
    return served


async def prompt_tokens_at(replica: str) -> float:
    """What the simulated replica itself counted (vllm:prompt_tokens): requests that reached it."""
    async with httpx.AsyncClient() as h:
        text = (await h.get(f"http://{replica}/metrics")).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "vllm:prompt_tokens_total"
    )


def entries(app: Any, replica: str) -> int:
    index = app.state.gw.index  # the memory index
    return int(index.size(Location(replica, Tier.HBM)) + index.size(Location(replica, Tier.CPU)))


async def healthy(app: Any, names: set[str]) -> None:
    replicas = app.state.gw.registry.replicas

    async def ready() -> bool:
        return set(replicas) == names and all(replicas[n].healthy for n in names)

    await until(f"{sorted(names)} healthy", ready)


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as s:
        yield s


async def test_a_headless_service_name_is_followed_as_its_addresses_change(
    dnsmasq: Dnsmasq, stack: AsyncExitStack
) -> None:
    port = free_port()
    hosts = ("127.0.0.2", "127.0.0.3", "127.0.0.4")  # loopback addresses, one per "pod"
    a, b, c = [await sim(stack, host, port) for host in hosts]
    dnsmasq.start({"vllm.test": hosts[:2]})
    app = create_app(
        discovered_config({"name": "vllm.test", "port": port, "nameservers": [dnsmasq.nameserver]})
    )
    url = await stack.enter_async_context(running_app(app))
    assert set(app.state.gw.registry.replicas) == {a, b}  # resolved before serving
    await healthy(app, {a, b})
    served = await send(url, 12, "before")
    assert served[a] and served[b]
    assert entries(app, a) > 0
    tokens_at_a = await prompt_tokens_at(a)

    dnsmasq.set_hosts({"vllm.test": hosts[1:]})  # a's pod is gone, c's is ready
    await two_more_resolutions(url)
    assert set(app.state.gw.registry.replicas) == {b, c}
    assert entries(app, a) == 0
    assert app.state.gw.registry.replicas[c].healthy  # checked as it joined

    served = await send(url, 16, "after")
    assert a not in served and served[c] > 0
    assert await prompt_tokens_at(a) == tokens_at_a  # nothing reached it, retries included
    assert (
        await metric(url, "cachelane_replica_changes_total", pool=POOL, change="added") == 3
    )  # a, b, c
    assert await metric(url, "cachelane_replica_changes_total", pool=POOL, change="removed") == 1

    dnsmasq.set_hosts({"other.test": ["127.0.0.9"]})  # the name no longer exists: no replica
    await two_more_resolutions(url)
    assert app.state.gw.registry.replicas == {}
    async with httpx.AsyncClient() as h:
        resp = await h.post(
            f"{url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
    assert resp.status_code == 503, resp.text  # the pool names the model: retry, not 404
    assert "retry-after" in resp.headers


async def test_srv_records_give_each_replica_its_port_and_a_failed_lookup_changes_nothing(
    dnsmasq: Dnsmasq, stack: AsyncExitStack
) -> None:
    a, b, c = [await sim(stack, "127.0.0.1", 0) for _ in range(3)]
    port = {name: int(name.rsplit(":", 1)[1]) for name in (a, b, c)}
    srv = "_http._tcp.vllm.test"
    dnsmasq.start(
        {"pods.test": ["127.0.0.1"]}, srv=[(srv, "pods.test", port[a]), (srv, "pods.test", port[b])]
    )
    app = create_app(
        discovered_config(
            {"name": srv, "type": "SRV", "nameservers": [dnsmasq.nameserver], "timeout_s": 0.3}
        )
    )
    url = await stack.enter_async_context(running_app(app))
    await healthy(app, {a, b})
    await send(url, 8, "before")

    dnsmasq.set_srv([(srv, "pods.test", port[b]), (srv, "pods.test", port[c])])
    await two_more_resolutions(url)
    assert set(app.state.gw.registry.replicas) == {b, c}
    assert entries(app, a) == 0
    served = await send(url, 12, "after")
    assert a not in served and served[c] > 0

    dnsmasq.stop()  # the DNS server is away: the replicas stay as they were, and keep serving
    await two_more_resolutions(url, "failed")
    assert set(app.state.gw.registry.replicas) == {b, c}
    assert sum((await send(url, 4, "dns down")).values()) == 4


async def test_a_discovered_replica_gets_its_kv_event_feed_and_loses_it_when_it_leaves(
    dnsmasq: Dnsmasq, stack: AsyncExitStack, tmp_path: Path
) -> None:
    """Precise mode: each replica's engine publishes KV events on its HTTP port + 1; a replica
    that joins is subscribed to at once (its events fill the index), one that leaves is not
    followed any more and its entries go."""
    files = write_tiny_tokenizer(tmp_path / "tokenizer")
    ports = [free_port_run(2) for _ in range(2)]  # (HTTP, HTTP + 1 for KV events) each
    names = []
    for http in ports:
        spec = SimReplicaSpec(
            name=f"sim-{http}",
            port=http,
            costs=FAST_COSTS,
            itl_s=0.001,
            block_size_tokens=16,
            kv_events_port=http + 1,
            tokenizer_path=str(files.tokenizer_json),
            chat_template=str(files.chat_template),
            bos_token=BOS,
            eos_token=EOS,
        )
        app = create_sim_app(spec)
        await stack.enter_async_context(running_app(app, port=http))
        names.append(f"127.0.0.1:{http}")
    a, b = names
    srv = "_http._tcp.vllm.test"
    dnsmasq.start({"pods.test": ["127.0.0.1"]}, srv=[(srv, "pods.test", ports[0])])
    config = discovered_config({"name": srv, "type": "SRV", "nameservers": [dnsmasq.nameserver]})
    data = config.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    data["routing"] = {"mode": "precise", "block_size_tokens": 16}
    data["pools"][0] |= {
        "kv_events": {"port_offset": 1},
        "tokenizer": {
            "path": str(files.tokenizer_json),
            "chat_template": str(files.chat_template),
            "bos_token": BOS,
            "eos_token": EOS,
        },
    }
    app = create_app(parse_config(data))
    url = await stack.enter_async_context(running_app(app))
    kv = app.state.gw.kv_events
    assert set(kv.feeds) == {a}
    await healthy(app, {a})
    assert await kv.wait_connected(WAIT_S)
    await send(url, 2, "first")

    async def a_indexed() -> bool:
        return entries(app, a) > 0

    await until("a's KV events in the index", a_indexed)

    dnsmasq.set_srv([(srv, "pods.test", ports[1])])
    await two_more_resolutions(url)
    assert set(kv.feeds) == {b}
    assert await kv.wait_connected(WAIT_S)
    served = await send(url, 3, "precise")
    assert set(served) == {b}

    async def b_indexed() -> bool:
        return entries(app, b) > 0

    await until("b's KV events in the index", b_indexed)  # only its events write there
    assert entries(app, a) == 0


async def test_resolve_brackets_ipv6_addresses_and_reads_a_missing_name_as_no_replica(
    dnsmasq: Dnsmasq,
) -> None:
    dnsmasq.start({"vllm.test": ["127.0.0.2", "fd00::7"], "pods.test": ["::1"]})
    srv = "_http._tcp.vllm.test"
    dnsmasq.set_srv([(srv, "pods.test", 9001)])

    def config(**d: Any) -> DiscoveryConfig:
        return DiscoveryConfig(nameservers=[dnsmasq.nameserver], **d)

    async def urls(d: DiscoveryConfig) -> list[str]:
        return await resolve(d, make_resolver(d))

    assert await urls(config(name="vllm.test", port=8000)) == [
        "http://127.0.0.2:8000",
        "http://[fd00::7]:8000",
    ]
    assert await urls(config(name=srv, type="SRV", scheme="https")) == ["https://[::1]:9001"]
    assert await urls(config(name="nothing.test", port=8000)) == []  # NXDOMAIN
    assert await urls(config(name="_http._tcp.nothing.test", type="SRV")) == []
    dnsmasq.stop()
    with pytest.raises(DiscoveryFailed):
        await urls(config(name="vllm.test", port=8000, timeout_s=0.3))
