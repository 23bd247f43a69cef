"""A replica is judged by its own faults, not by what a request made it say, on real servers: a
gateway with two tenants in front of simulated replicas, all uvicorn on loopback.

- numbers past what OpenAI's API allows are refused with 400 before anything is sent;
- an answer that echoes a number no 64-bit parser takes (a field the gateway passes on) is a
  valid answer, not a garbled one;
- one tenant's requests that fail on every replica (whole answers longer than their deadline
  allows) never eject a healthy replica: it is probed, passes, and stays in;
- two tenants' requests failing on it do eject it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from tests.integration.fleet import MODEL, Fleet, fleet

A_KEY = "tenant-a-key-" + "a" * 32
B_KEY = "tenant-b-key-" + "b" * 32
TENANTS = [
    {"name": "tenant-a", "api_key": A_KEY, "class": "standard"},
    {"name": "tenant-b", "api_key": B_KEY, "class": "standard"},
]
EJECT_AFTER_ERRORS = 3
# The replicas decode a token per 20 ms, the pool's deadline expects 1,000 tokens/s: a whole
# answer of 200 tokens is due in 0.5 + 0.2 s and takes 4 s, while the probe's one token (and any
# short answer) comes in a few milliseconds
ITL_S = 0.02
POOL = {"first_byte_timeout_s": 0.5, "min_decode_tokens_per_s": 1000.0}
LONG_OUTPUT_TOKENS = 200


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", "content-type": "application/json"}


@asynccontextmanager
async def two_tenants() -> AsyncIterator[Fleet]:
    async with fleet(
        2,
        itl_s=ITL_S,
        pool=POOL,
        tenants=TENANTS,
        health={  # lenient checks: only the requests' errors may take a replica out here
            "interval_s": 0.1,
            "timeout_s": 2.0,
            "fail_after": 3,
            "eject_after_errors": EJECT_AFTER_ERRORS,
            "ejection_s": 60.0,
        },
    ) as f:
        yield f


def long_request(i: int) -> dict[str, Any]:
    """A whole answer too long for its deadline."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {i}"}],
        "max_tokens": LONG_OUTPUT_TOKENS,
    }


def healthy_count(f: Fleet) -> int:
    return sum(r.healthy for r in f.gw.registry.replicas.values())


async def until_healthy(f: Fleet) -> None:
    for _ in range(100):  # at most ~5 s
        if healthy_count(f) == 2:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the fleet never became healthy")


@pytest.mark.parametrize(
    ("field", "raw"),
    [
        ("temperature", b"1" + b"0" * 400),
        ("temperature", b"2.5"),
        ("top_p", b"-0.1"),
        ("top_p", b"1.01"),
        ("n", b"0"),
        ("seed", b"9" * 30),
        ("max_output_tokens", b"1" + b"0" * 400),
        ("frequency_penalty", b"3"),
    ],
)
async def test_numbers_beyond_the_api_are_refused_before_they_leave(field: str, raw: bytes) -> None:
    async with two_tenants() as f, httpx.AsyncClient(timeout=10) as h:
        await until_healthy(f)
        body = b'{"model": "%s", "input": "hi", "%s": %s}' % (MODEL.encode(), field.encode(), raw)
        r = await h.post(f"{f.gateway_url}/v1/responses", content=body, headers=bearer(A_KEY))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field
        assert error["type"] == "invalid_request_error"
        assert error["code"].endswith(("_min_value", "_max_value")), error
        assert len(error["message"]) < 200  # 10**400 is not printed whole
        stats = f.gw.metrics.registry.get_sample_value
        assert stats("cachelane_errors_total", {"code": error["code"]}) == 1.0


async def test_an_echoed_number_past_64_bits_is_an_answer_not_a_fault() -> None:
    async with two_tenants() as f, httpx.AsyncClient(timeout=10) as h:
        await until_healthy(f)
        huge = b"1" + b"0" * 400  # orjson refuses integers past 64 bits; the sim echoes metadata
        body = b'{"model": "%s", "input": "hi", "max_output_tokens": 2, "metadata": {"x": %s}}' % (
            MODEL.encode(),
            huge,
        )
        for _ in range(EJECT_AFTER_ERRORS * 2):
            r = await h.post(f"{f.gateway_url}/v1/responses", content=body, headers=bearer(A_KEY))
            assert r.status_code == 200, r.text
            assert huge in r.content
        assert all(r.consecutive_errors == 0 for r in f.gw.registry.replicas.values())
        assert healthy_count(f) == 2


async def test_no_sequence_of_one_tenants_requests_ejects_a_healthy_replica() -> None:
    async with two_tenants() as f, httpx.AsyncClient(timeout=10) as h:
        await until_healthy(f)
        url = f"{f.gateway_url}/v1/chat/completions"

        async def failing(i: int) -> int:
            r = await h.post(url, json=long_request(i), headers=bearer(A_KEY))
            return r.status_code

        for wave in range(2):  # each request fails on both replicas (504)
            n = EJECT_AFTER_ERRORS * 2
            statuses = await asyncio.gather(*(failing(wave * n + i) for i in range(n)))
            assert set(statuses) == {504}
            assert healthy_count(f) == 2
        suspects = 0
        for _ in range(100):  # the probes clear them, within ~5 s
            suspects = sum(r.suspect is not None for r in f.gw.registry.replicas.values())
            if not suspects:
                break
            await asyncio.sleep(0.05)
        assert suspects == 0
        assert healthy_count(f) == 2
        ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert (await h.post(url, json=ok, headers=bearer(A_KEY))).status_code == 200


async def test_two_tenants_failing_requests_eject_the_replica() -> None:
    async with two_tenants() as f, httpx.AsyncClient(timeout=10) as h:
        await until_healthy(f)
        url = f"{f.gateway_url}/v1/chat/completions"
        for i in range(EJECT_AFTER_ERRORS):
            key = (A_KEY, B_KEY)[i % 2]
            await h.post(url, json=long_request(i), headers=bearer(key))
        assert healthy_count(f) == 0
        assert {r.ejection_reason for r in f.gw.registry.replicas.values()} == {"timeout"}
