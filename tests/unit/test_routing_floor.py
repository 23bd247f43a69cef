"""loadtest/bench/bare_proxy.py's RoutingFloor: the bare proxy routing by KV cache with
cachelane's routing/ code, the floor overhead_floor states beside cachelane."""

from __future__ import annotations

import orjson

from loadtest.bench.bare_proxy import RoutingFloor

REPLICAS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


def chat(system: str, question: str) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return orjson.dumps({"model": "m", "messages": messages, "stream": True})


def test_a_prompt_that_shares_a_prefix_goes_where_the_prefix_went() -> None:
    floor = RoutingFloor(REPLICAS)
    document = "A timetable excerpt: the 8:15 to Leeds calls at York and Wakefield. " * 60
    first = floor._choose(chat(document, "When does it leave?"))
    floor._in_flight[first] += 1  # still in flight: by load alone the other replica would win
    assert floor._choose(chat(document, "Where does it call?")) == first


def test_cold_prompts_spread_by_load() -> None:
    floor = RoutingFloor(REPLICAS)
    first = floor._choose(chat("one " * 200, "q"))
    floor._in_flight[first] += 1
    assert floor._choose(chat("another " * 200, "q")) != first
