"""gateway/http/body.py: the body parser's bounds, and large bodies parsed off the event loop."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from gateway.http.body import BodyError, parse_body, parse_body_async


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"[1]", "invalid_json"),
        (b'{"a": NaN}', "invalid_json"),
        (b'{"a": -Infinity}', "invalid_json"),
        (b'{"a": 1e400}', "number_too_large"),
        (b'{"a": %s}' % (b"1" * 21), "number_too_large"),
        (b'{"a": 1.%s}' % (b"0" * 20), "number_too_large"),
        (b'{"a": [[[]]]}', "json_too_deep"),
        (b'{"a": {"b": {"c": {}}}}', "json_too_deep"),
        (b'{"a": "\\ud83d"}', "invalid_unicode"),
        (b'{"\\udc00": 1}', "invalid_unicode"),
        (b'{"a": "\xc3"}', "invalid_json"),
        (b'{"a": %s}' % (b"[" * 50_000), "json_too_deep"),
    ],
)
def test_refused(raw: bytes, code: str) -> None:
    with pytest.raises(BodyError) as err:
        parse_body(raw, max_depth=3, max_number_chars=20)
    assert err.value.code == code


def test_accepted_at_the_limits() -> None:
    raw = b'{"a": [[%s]], "b": "\\ud83d\\ude00 \xc3\xa9", "c": 1.5}' % (b"9" * 20)
    body = parse_body(raw, max_depth=3, max_number_chars=20)
    assert body == {"a": [[int("9" * 20)]], "b": "\N{GRINNING FACE} é", "c": 1.5}


async def test_a_large_body_leaves_the_event_loop_running() -> None:
    """8 MiB of token ids take ~0.1-0.5 s to parse; parsed in a worker thread, the loop keeps
    ticking (the number hooks let the interpreter switch threads), where on the loop it would
    stop for the whole parse."""
    raw = json.dumps({"model": "m", "prompt": list(range(1_000_000))}).encode()
    gaps: list[float] = []

    async def tick() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    body = await parse_body_async(raw)
    took = time.perf_counter() - started
    ticker.cancel()
    assert len(body["prompt"]) == 1_000_000
    assert max(gaps) < took / 3, (max(gaps), took)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "seed": 123456789012345678901234567890}',  # past int64: exact int
        b'{"model": "m", "x": -9223372036854775809}',
        b'{"model": "m", "x": 1.5, "y": [1, {"z": null}], "t": "caf\\u00e9 \\ud83d\\ude00"}',
        b'{"a": 1, "a": 2}',
        b'{"model": "m", "n": 1e308, "m": -0.0}',
    ],
    ids=["big-int", "big-negative-int", "mixed", "duplicate-key", "floats"],
)
def test_the_fast_path_and_the_bounded_parser_agree(raw: bytes) -> None:
    assert parse_body(raw) == json.loads(raw)
    assert type(parse_body(raw).get("seed", 0)) is int


def test_a_number_longer_than_the_limit_is_refused_by_either_path() -> None:
    with pytest.raises(BodyError) as caught:
        parse_body(b'{"model": "m", "max_tokens": 12345678}', max_number_chars=5)
    assert caught.value.code == "number_too_large"
