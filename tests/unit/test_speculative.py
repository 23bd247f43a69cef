"""Speculative marks in precise mode (routing/speculative.py): seen at once, settled by events."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from routing.index import MemoryIndex
from routing.speculative import SpeculativeIndex
from routing.types import Location, Tier

A = Location("a:1", Tier.HBM)
B = Location("b:1", Tier.HBM)
T = TypeVar("T")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(ttl_s: float = 10.0, max_marks: int = 1000) -> tuple[SpeculativeIndex, Clock]:
    clock = Clock()
    inner = MemoryIndex(ttl_s=600.0)
    return SpeculativeIndex(
        inner, ttl_s=ttl_s, max_marks_per_location=max_marks, clock=clock
    ), clock


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def test_a_mark_is_a_hit_until_it_expires() -> None:
    idx, clock = make()
    idx.speculate("m", [1, 2, 3], A)
    assert run(idx.lookup("m", [1, 2, 3, 4])) == [frozenset({A})] * 3
    clock.now += 10.0
    assert run(idx.lookup("m", [1, 2, 3])) == []
    idx.speculate("m", [9], A)  # sweeps the expired ones
    assert idx.marks() == 1


def test_marks_extend_what_the_events_reported() -> None:
    idx, _ = make()
    run(idx.inner.record("m", [1, 2], B))
    idx.speculate("m", [1, 2, 3], A)
    assert run(idx.lookup("m", [1, 2, 3])) == [frozenset({A, B})] * 2 + [frozenset({A})]


def test_events_settle_marks() -> None:
    idx, clock = make()
    idx.speculate("m", [1, 2, 3], A)
    run(idx.record("m", [1, 2], A))  # BlockStored: real entries now
    run(idx.evict("m", [3], A))  # BlockRemoved
    assert idx.marks() == 0
    clock.now += 60.0  # the real entries outlive the marks' TTL
    assert run(idx.lookup("m", [1, 2, 3])) == [frozenset({A})] * 2


def test_a_replica_that_goes_away_loses_its_marks() -> None:
    idx, _ = make()
    idx.speculate("m", [1, 2], A)
    idx.speculate("m", [1, 2], B)
    run(idx.drop_replica("a:1"))
    assert run(idx.lookup("m", [1, 2])) == [frozenset({B})] * 2


def test_marks_are_bounded_per_location() -> None:
    idx, _ = make(max_marks=4)
    idx.speculate("m", list(range(10)), A)
    assert idx.marks() == 4
    assert run(idx.lookup("m", [6, 7, 8, 9])) == [frozenset({A})] * 4
    assert run(idx.lookup("m", [0])) == []


def test_a_re_marked_block_keeps_its_newer_expiry() -> None:
    idx, clock = make(ttl_s=10.0)
    idx.speculate("m", [1], A)
    clock.now += 6.0
    idx.speculate("m", [1], A)
    clock.now += 6.0  # the first mark's deadline has passed, the second's has not
    idx.speculate("m", [2], A)  # a sweep
    assert run(idx.lookup("m", [1])) == [frozenset({A})]
