"""gateway/fleet/siblings.py: two workers' ends in one process, on real Unix sockets in a temporary
directory (each end named after a live process: this one and its parent)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import parse_config
from gateway.fleet.registry import Registry
from gateway.fleet.siblings import Siblings, merge_expositions
from routing.index import MemoryIndex
from routing.types import Location, Tier

BOUND_S = 5.0  # waits for a message end when it arrives; this bounds a broken test, nothing more
URLS = ["http://replica-a:8000", "http://replica-b:8000"]
A = "replica-a:8000"


@dataclass
class Worker:
    registry: Registry
    index: MemoryIndex
    siblings: Siblings
    shared: object  # the index this worker routes on


def worker(directory: Path, pid: int, metrics: Callable[[], bytes] = lambda: b"") -> Worker:
    config = parse_config(
        {"engine_metrics": {"enabled": False}, "pools": [{"name": "p", "replicas": URLS}]}
    )
    registry = Registry(config)
    siblings = Siblings(directory, registry, metrics, pid=pid)
    registry.load_listener = siblings
    index = MemoryIndex()
    return Worker(registry, index, siblings, siblings.share_index(index))


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[Worker, Worker]]:
    one, two = worker(tmp_path, os.getpid()), worker(tmp_path, os.getppid())
    tasks = [one.siblings.start(), two.siblings.start()]
    one.siblings._refresh()  # both sockets exist now: each finds the other at once
    yield one, two
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    one.siblings.close()
    two.siblings.close()


async def until(condition: Callable[[], bool], poll_s: float = 0.001) -> None:
    for _ in range(int(BOUND_S / poll_s)):
        if condition():
            return
        await asyncio.sleep(poll_s)
    raise AssertionError("the sibling's message never arrived")


async def test_a_record_reaches_the_sibling_index(pair: tuple[Worker, Worker]) -> None:
    one, two = pair
    where = Location(A, Tier.HBM)
    await one.shared.record("m", [2**64 - 1, 7, 9], where)  # type: ignore[attr-defined]
    await until(lambda: bool(two.index.lookup_now("m", [2**64 - 1, 7, 9])))
    assert two.index.lookup_now("m", [2**64 - 1, 7, 9]) == [{where}] * 3


async def test_a_reservation_counts_on_the_sibling_until_it_ends(
    pair: tuple[Worker, Worker],
) -> None:
    one, two = pair
    mine, theirs = one.registry.replicas[A], two.registry.replicas[A]
    reservation = one.registry.reserve(mine, prefill_tokens=512, swaps=0, priority=-1)
    await until(lambda: theirs.in_flight == 1)
    assert theirs.pending_prefill_tokens == 512
    assert [q.priority for q in theirs.load(0.0, 1.0).queue] == [-1]  # the engine priority too
    assert two.registry.replicas[A].load(0.0, 1.0).in_flight == 1
    reservation.first_byte()
    await until(lambda: theirs.pending_prefill_tokens == 0)
    assert theirs.in_flight == 1  # decoding: still in flight
    reservation.release()
    await until(lambda: theirs.in_flight == 0)
    assert not theirs.joining
    assert mine.in_flight == 0  # its own count is its own: the echo is not applied twice
    assert two.siblings.status()["shadow_reservations"] == 0


async def test_a_sibling_that_is_gone_takes_its_load_with_it(tmp_path: Path) -> None:
    stand_in = await asyncio.create_subprocess_exec("sleep", "30")  # the dying worker's pid
    one = worker(tmp_path, stand_in.pid)
    two = worker(tmp_path, os.getpid())
    tasks = [one.siblings.start(), two.siblings.start()]
    one.siblings._refresh()
    try:
        one.registry.reserve(one.registry.replicas[A], prefill_tokens=64, swaps=0)
        theirs = two.registry.replicas[A]
        await until(lambda: theirs.in_flight == 1)
        stand_in.kill()
        await stand_in.wait()
        two.siblings._refresh()
        assert (theirs.in_flight, theirs.joining) == (0, {})
        assert not (tmp_path / f"worker-{stand_in.pid}.sock").exists()
    finally:
        if stand_in.returncode is None:
            stand_in.kill()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        one.siblings.close()
        two.siblings.close()


def exposition(requests: float, in_flight: float, latencies: list[float]) -> bytes:
    registry = CollectorRegistry()
    Counter("demo_requests", "requests", ["status"], registry=registry).labels("200").inc(requests)
    Gauge("demo_in_flight", "in flight", registry=registry).set(in_flight)
    histogram = Histogram("demo_seconds", "latency", buckets=(0.1, 1.0), registry=registry)
    for value in latencies:
        histogram.observe(value)
    return generate_latest(registry)


def test_merged_metrics_add_counters_and_histograms_and_keep_the_largest_gauge() -> None:
    merged = merge_expositions([exposition(3, 2, [0.05]), exposition(4, 5, [0.5, 2.0])])
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(merged.decode())
        for s in family.samples
    }
    assert samples[("demo_requests_total", (("status", "200"),))] == 7
    assert samples[("demo_in_flight", ())] == 5
    assert samples[("demo_seconds_bucket", (("le", "0.1"),))] == 1
    assert samples[("demo_seconds_bucket", (("le", "1.0"),))] == 2
    assert samples[("demo_seconds_bucket", (("le", "+Inf"),))] == 3
    assert samples[("demo_seconds_count", ())] == 3
    assert samples[("demo_seconds_sum", ())] == pytest.approx(2.55)


async def test_merged_metrics_ask_each_sibling(tmp_path: Path) -> None:
    one = worker(tmp_path, os.getpid(), lambda: exposition(1, 1, []))
    two = worker(tmp_path, os.getppid(), lambda: exposition(10, 0, []))
    tasks = [one.siblings.start(), two.siblings.start()]
    one.siblings._refresh()
    try:
        await until(lambda: (tmp_path / f"metrics-{os.getppid()}.sock").exists())
        merged = await one.siblings.merged_metrics(exposition(1, 1, []))
        assert b'demo_requests_total{status="200"} 11.0' in merged
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        one.siblings.close()
        two.siblings.close()


async def test_a_lost_end_is_mended_by_the_next_snapshot(pair: tuple[Worker, Worker]) -> None:
    one, two = pair
    theirs = two.registry.replicas[A]
    reservation = one.registry.reserve(one.registry.replicas[A], prefill_tokens=32, swaps=0)
    await until(lambda: theirs.in_flight == 1)
    one.registry.load_listener = None  # its end is never published, as if the datagram was lost
    reservation.listener = None
    reservation.release()
    one.siblings._live.discard(id(reservation))
    assert theirs.in_flight == 1
    one.siblings._publish(b"S" + b"[]")  # what _keep_peers sends every REFRESH_S
    await until(lambda: theirs.in_flight == 0)
    assert not theirs.joining


async def test_datagrams_a_busy_sibling_refuses_wait_and_keep_their_order(
    pair: tuple[Worker, Worker],
) -> None:
    one, two = pair
    theirs = two.registry.replicas[A]
    loop = asyncio.get_running_loop()
    loop.remove_reader(two.siblings._sock.fileno())  # the sibling stops reading for a while
    for _ in range(40):  # far more datagrams than its socket queues (net.unix.max_dgram_qlen)
        r = one.registry.reserve(one.registry.replicas[A], prefill_tokens=8, swaps=0)
        await asyncio.sleep(0)
        r.release()
        await asyncio.sleep(0)
    assert sum(len(q) for q in one.siblings._pending.values()) > 0
    loop.add_reader(two.siblings._sock.fileno(), two.siblings._on_readable)
    await until(lambda: not any(one.siblings._pending.values()))
    await until(lambda: two.siblings.received >= 80)
    assert (theirs.in_flight, theirs.joining) == (0, {})  # every end came after its start
    assert one.siblings.dropped == 0
