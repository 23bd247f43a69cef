"""Property-based fuzz of the request bodies: whatever a client sends to the chat, completions
and responses endpoints, the gateway answers below 500, every error in the OpenAI envelope, and
keeps serving; and the one request schema (gateway/http/request_schema.py) holds on all three: every
body it refuses gets a 400. Real gateways (approximate and precise mode) in front of simulated
replicas on loopback; hypothesis draws bodies shaped like the OpenAI schema with any JSON in any
place, lone surrogates, numbers past every limit, deep nesting and bytes that are not JSON.

Bounded: a fixed number of examples and a deadline per example. A failure prints the falsifying
body and a blob to reproduce it (@reproduce_failure)."""

from __future__ import annotations

import asyncio
import json
import math
from datetime import timedelta
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.http.body import BodyError, parse_body
from gateway.http.request_schema import schema_problem
from loadtest.sim.tiny_tokenizer import TinyTokenizerFiles
from tests.integration.fleet import MODEL, fleet
from tests.integration.test_input import errors_by_code, is_envelope
from tests.integration.test_precise import precise_fleet, tokenizer_files

pytestmark = pytest.mark.slow  # `make check` leaves it out: hypothesis drives hundreds of requests

__all__ = ["tokenizer_files"]  # the precise fleet's fixture, used here too

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
ENDPOINT_OF = {CHAT: "chat", COMPLETIONS: "completions", RESPONSES: "responses"}


class Raw(str):
    """JSON text written as it is: numbers longer than int() prints, nesting deeper than
    json.dumps recurses."""


def dump(value: Any) -> str:
    """JSON text of `value`; lone surrogates become \\udxxx escapes, NaN and infinities their
    non-JSON literals (both as a client might send them)."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dump(v) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return json.dumps(value)


def mostly(
    typical: st.SearchStrategy[Any], odd: st.SearchStrategy[Any], one_in: int = 8
) -> st.SearchStrategy[Any]:
    """`typical`, and `odd` about once in `one_in` draws: most bodies are wrong in one place or
    none, so the fuzz reaches the code behind the first check."""
    return st.integers(1, one_in).flatmap(lambda i: odd if i == 1 else typical)


# lone surrogates (category Cs) in one text in five
TEXT = mostly(
    st.text(st.characters(), max_size=12),
    st.text(st.characters() | st.characters(categories=["Cs"]), min_size=1, max_size=6),
)
BIG = st.integers(15, 6000).map(lambda n: Raw("-" * (n % 2) + "9" * n))
DEEP = st.integers(2, 3000).map(lambda n: Raw("[" * n + "]" * n))
SCALARS = mostly(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT,
    st.floats(allow_nan=True, allow_infinity=True) | BIG,
)
ANY = mostly(
    st.recursive(
        SCALARS,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
        max_leaves=8,
    ),
    DEEP,
)


def either(*typical: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the typical shape, sometimes any JSON at all."""
    return mostly(st.one_of(*typical), ANY)


PART = either(
    st.fixed_dictionaries(
        {
            "type": either(st.sampled_from(["text", "input_text", "output_text"])),
            "text": either(TEXT),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["image_url", "input_image"]),
            "image_url": either(st.fixed_dictionaries({"url": either(TEXT)})),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("input_audio"),
            "input_audio": either(st.fixed_dictionaries({"data": either(TEXT), "format": TEXT})),
        }
    ),
    TEXT,
)
TOOL_CALL = either(
    st.fixed_dictionaries(
        {
            "id": either(TEXT),
            "type": st.just("function"),
            "function": either(
                st.fixed_dictionaries({"name": either(TEXT), "arguments": either(TEXT)})
            ),
        }
    )
)
MESSAGE = either(
    st.fixed_dictionaries(
        {
            "role": either(st.sampled_from(["system", "user", "assistant", "tool"])),
            "content": either(TEXT, st.lists(PART, max_size=3)),
        },
        optional={
            "name": either(TEXT),
            "tool_calls": either(st.lists(TOOL_CALL, max_size=2)),
            "tool_call_id": either(TEXT),
        },
    )
)
FUNCTION = st.fixed_dictionaries(
    {"name": either(TEXT)}, optional={"parameters": either(st.just({"type": "object"}))}
)
CHAT_TOOL = either(
    st.fixed_dictionaries({"type": st.just("function"), "function": either(FUNCTION)})
)
RESPONSES_TOOL = either(FUNCTION.map(lambda f: {"type": "function", **f}))
RESPONSES_ITEM = either(
    st.fixed_dictionaries(
        {
            "role": either(st.sampled_from(["system", "user", "assistant", "developer"])),
            "content": either(TEXT, st.lists(PART, max_size=3)),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": either(TEXT),
            "name": either(TEXT),
            "arguments": either(TEXT),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": either(TEXT), "output": either(TEXT)}
    ),
)
INPUT = either(TEXT, st.lists(RESPONSES_ITEM, min_size=1, max_size=3))
TOKEN = st.integers(-5, 200_000) | st.integers() | BIG
PROMPT = either(
    TEXT,
    st.lists(TEXT, min_size=1, max_size=3),
    st.lists(TOKEN, min_size=1, max_size=40),
    st.lists(st.lists(TOKEN, min_size=1, max_size=20), min_size=1, max_size=2),
)
# a valid max_tokens stays small: the simulator generates exactly that many tokens
MAX_TOKENS = mostly(st.integers(1, 3), st.none() | TEXT | st.lists(SCALARS, max_size=2) | BIG)
EXTRA_KEYS = [
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "user",
    "n",
    "tools",
    "tool_choice",
    "response_format",
    "logprobs",
    "priority",
    "add_special_tokens",
    "add_generation_prompt",
    "chat_template_kwargs",
    "cache_salt",
]
EXTRA = st.dictionaries(st.sampled_from(EXTRA_KEYS) | TEXT, either(st.booleans()), max_size=3)


@st.composite
def request_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """(path, raw body): an OpenAI-shaped body with anything anywhere, or bytes."""
    shape = draw(st.sampled_from(["chat", "completions", "responses"] * 3 + ["bytes", "json"]))
    # mostly the endpoint the body is for
    home = {"chat": CHAT, "completions": COMPLETIONS, "responses": RESPONSES}.get(shape, CHAT)
    path = draw(mostly(st.just(home), st.sampled_from([CHAT, COMPLETIONS, RESPONSES])))
    if shape == "bytes":
        return path, draw(st.binary(max_size=64))
    if shape == "json":
        return path, dump(draw(ANY)).encode()
    body: dict[str, Any] = {"model": draw(mostly(st.just(MODEL), ANY))}
    if shape == "chat":
        body["messages"] = draw(either(st.lists(MESSAGE, min_size=1, max_size=3)))
        body["tools"] = draw(mostly(st.none(), either(st.lists(CHAT_TOOL, max_size=2)), 3))
    elif shape == "responses":
        body["input"] = draw(INPUT)
        body["tools"] = draw(mostly(st.none(), either(st.lists(RESPONSES_TOOL, max_size=2)), 3))
    else:
        body["prompt"] = draw(PROMPT)
    body["max_output_tokens" if shape == "responses" else "max_tokens"] = draw(MAX_TOKENS)
    body["stream"] = draw(mostly(st.just(False), either(st.booleans()), 4))
    body |= {k: v for k, v in draw(EXTRA).items() if k not in body}
    return path, dump(body).encode()


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=timedelta(seconds=5),
        database=None,  # nothing written to .hypothesis/ in the work tree
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )


async def fuzz(gateway_url: str, examples: int) -> None:
    """Runs hypothesis in a worker thread with a blocking client, so the gateway (served by this
    event loop) answers meanwhile."""

    def run() -> None:
        with httpx.Client(base_url=gateway_url, timeout=10) as h:

            @fuzz_settings(examples)
            @given(request_bodies())
            def no_5xx(case: tuple[str, bytes]) -> None:
                path, raw = case
                r = h.post(path, content=raw, headers={"content-type": "application/json"})
                assert r.status_code < 500, (r.status_code, r.text[:300])
                problem = schema_of(path, raw)
                if problem is not None:  # the schema holds on every endpoint
                    assert r.status_code == 400, (problem, r.status_code, r.text[:300])
                if r.status_code >= 400:
                    assert is_envelope(r.json()), r.text[:300]
                    event(f"{r.status_code} {r.json()['error']['code']}")
                else:
                    event(str(r.status_code))

            no_5xx()

    await asyncio.to_thread(run)


def schema_of(path: str, raw: bytes) -> str | None:
    """What the request schema refuses in this body (None: it passes, or it is not JSON)."""
    try:
        body = parse_body(raw)
    except BodyError:
        return None
    problem = schema_problem(ENDPOINT_OF[path], body)
    return None if problem is None else problem.param


async def check_still_serving(gateway_url: str) -> None:
    async with httpx.AsyncClient(base_url=gateway_url, timeout=10) as h:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert (await h.post(CHAT, json=body)).status_code == 200
        errors = errors_by_code((await h.get("/metrics")).text)
    assert "internal_error" not in errors, errors


async def test_fuzzed_bodies_never_get_5xx() -> None:
    async with fleet(1) as f:
        await fuzz(f.gateway_url, examples=1200)
        await check_still_serving(f.gateway_url)


async def test_fuzzed_bodies_never_get_5xx_in_precise_mode(
    tokenizer_files: TinyTokenizerFiles,
) -> None:
    async with precise_fleet(tokenizer_files, n=1) as f:
        await fuzz(f.gateway_url, examples=800)
        await check_still_serving(f.gateway_url)
