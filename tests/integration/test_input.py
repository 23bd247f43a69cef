"""Client input never makes the gateway answer 5xx: each bad body is a 400
in the OpenAI error envelope, counted by its code, its neighbours unaffected; a non-ASCII tenant
or share-group name is served; an unexpected error's traceback is logged once; large bodies are
parsed off the event loop. Real gateways and simulated replicas on loopback."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

import httpx
import pytest

from gateway.http import body as body_module
from loadtest.sim.protocol import VOCAB_SIZE
from loadtest.sim.tiny_tokenizer import TinyTokenizerFiles
from tests.integration.fleet import MODEL, fleet
from tests.integration.test_precise import precise_fleet, tokenizer_files

__all__ = ["tokenizer_files"]  # the precise fleet's fixture, used here too

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
M = MODEL.encode()


def chat_body(*messages: dict[str, Any], **extra: Any) -> bytes:
    return json.dumps(
        {"model": MODEL, "messages": list(messages), "max_tokens": 2, **extra}
    ).encode()


def user(content: Any, **fields: Any) -> dict[str, Any]:
    return {"role": "user", "content": content, **fields}


DEEP = 100_000
# (case, endpoint, raw body, expected error code)
BAD_BODIES: list[tuple[str, str, bytes, str]] = [
    ("tool_calls a number", CHAT, chat_body(user("x", tool_calls=5)), "invalid_request"),
    ("tool_calls a string", CHAT, chat_body(user("x", tool_calls="call")), "invalid_request"),
    ("tool_calls of numbers", CHAT, chat_body(user("x", tool_calls=[1, 2])), "invalid_request"),
    (
        "image part with a numeric url",
        CHAT,
        chat_body(user([{"type": "image_url", "image_url": {"url": 5}}])),
        "invalid_request",
    ),
    (
        "image part with a list",
        CHAT,
        chat_body(user([{"type": "image_url", "image_url": [1]}])),
        "invalid_request",
    ),
    (
        "audio part with numeric data",
        CHAT,
        chat_body(user([{"type": "input_audio", "input_audio": {"data": 7}}])),
        "invalid_request",
    ),
    ("content list of numbers", CHAT, chat_body(user([1, 2])), "invalid_request"),
    ("content an object", CHAT, chat_body(user({"a": 1})), "invalid_request"),
    (
        "text part with an object",
        CHAT,
        chat_body(user([{"type": "text", "text": {"a": 1}}])),
        "invalid_request",
    ),
    (
        "text part with a number",
        CHAT,
        chat_body(user([{"type": "text", "text": 3}])),
        "invalid_request",
    ),
    (
        "lone surrogate in content",
        CHAT,
        b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % M,
        "invalid_unicode",
    ),
    (
        "lone surrogate in an image url",
        CHAT,
        b'{"model": "%s", "messages": [{"role": "user", "content": [{"type": "image_url", '
        b'"image_url": {"url": "\\udc00"}}]}]}' % M,
        "invalid_unicode",
    ),
    (
        "lone surrogate in a key",
        COMPLETIONS,
        b'{"model": "%s", "prompt": "x", "\\udfff": 1}' % M,
        "invalid_unicode",
    ),
    (
        "invalid UTF-8",
        CHAT,
        b'{"model": "%s", "messages": [{"role": "user", "content": "\xff\xfe"}]}' % M,
        "invalid_json",
    ),
    (
        "5000-digit token id",
        COMPLETIONS,
        b'{"model": "%s", "prompt": [%s]}' % (M, b"9" * 5000),
        "number_too_large",
    ),
    (
        "5000-digit number in a tool call",
        CHAT,
        b'{"model": "%s", "messages": [{"role": "assistant", "content": "x", '
        b'"tool_calls": [{"id": %s}]}]}' % (M, b"9" * 5000),
        "number_too_large",
    ),
    (
        "5000-digit number in a part",
        CHAT,
        b'{"model": "%s", "messages": [{"role": "user", "content": [{"type": "x", "v": %s}]}]}'
        % (M, b"9" * 5000),
        "number_too_large",
    ),
    (
        "1001-digit number (above the cap, below int's limit)",
        COMPLETIONS,
        b'{"model": "%s", "prompt": "x", "seed": %s}' % (M, b"1" * 1001),
        "number_too_large",
    ),
    (
        "float out of range",
        COMPLETIONS,
        b'{"model": "%s", "prompt": "x", "temperature": 1e999}' % M,
        "number_too_large",
    ),
    ("NaN", COMPLETIONS, b'{"model": "%s", "prompt": "x", "temperature": NaN}' % M, "invalid_json"),
    (
        "100000-deep arrays",
        COMPLETIONS,
        b'{"model": "%s", "prompt": "x", "x": %s%s}' % (M, b"[" * DEEP, b"]" * DEEP),
        "json_too_deep",
    ),
    (
        "5000-deep arrays in a tool call",
        CHAT,
        b'{"model": "%s", "messages": [{"role": "user", "content": "x", "tool_calls": [%s%s]}]}'
        % (M, b"[" * 5000, b"]" * 5000),
        "json_too_deep",
    ),
    (
        "129 levels (one past the cap)",
        COMPLETIONS,
        b'{"model": "%s", "prompt": "x", "x": %s%s}' % (M, b"[" * 128, b"]" * 128),
        "json_too_deep",
    ),
]


def errors_by_code(metrics_text: str) -> dict[str, float]:
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith("cachelane_errors_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('code="')[1].split('"')[0]] = float(value)
    return out


def is_envelope(payload: Any) -> bool:
    error = payload.get("error") if isinstance(payload, dict) else None
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}


async def test_bad_bodies_are_400_envelopes_counted_and_harm_no_other_request() -> None:
    async with fleet(1) as f:
        async with httpx.AsyncClient(base_url=f.gateway_url, timeout=30) as h:
            # a stream in flight across all of them: it must finish whole
            streaming = asyncio.create_task(
                h.post(
                    CHAT,
                    content=chat_body(user("keep streaming"), stream=True, max_tokens=300),
                    headers={"content-type": "application/json"},
                )
            )
            failures = []
            for case, path, raw, code in BAD_BODIES:
                r = await h.post(path, content=raw, headers={"content-type": "application/json"})
                json_type = r.headers.get("content-type") == "application/json"
                payload: Any = r.json() if json_type else None
                if r.status_code != 400 or not is_envelope(payload):
                    failures.append(f"{case}: {r.status_code} {r.text[:200]}")
                elif payload["error"]["code"] != code:
                    failures.append(f"{case}: code {payload['error']['code']}, expected {code}")
            assert not failures, "\n".join(failures)

            # 128 levels (the cap) is fine
            at_cap = b'{"model": "%s", "prompt": "x", "max_tokens": 2, "x": %s%s}' % (
                M,
                b"[" * 127,
                b"]" * 127,
            )
            assert (await h.post(COMPLETIONS, content=at_cap)).status_code == 200
            ok = await h.post(CHAT, content=chat_body(user("after all that")))
            assert ok.status_code == 200, ok.text
            stream = await streaming
            assert stream.status_code == 200
            assert stream.text.count('"content":') >= 300  # all 300 tokens, then the end
            assert '"finish_reason":"length"' in stream.text
            assert stream.text.rstrip().endswith("data: [DONE]")

            errors = errors_by_code((await h.get("/metrics")).text)
    assert "internal_error" not in errors
    expected: dict[str, float] = {}
    for _, _, _, code in BAD_BODIES:
        expected[code] = expected.get(code, 0) + 1
    assert errors == expected


TENANTS = [
    {"name": "zurich.ch", "api_key": "key-zurich-0123456789abcdef012345", "class": "standard"},
    {
        "name": "grp-member",
        "api_key": "key-member-0123456789abcdef012345",
        "class": "standard",
        "share_group": "team_tokyo.1",
    },
    {"name": "ascii", "api_key": "key-ascii-0123456789abcdef0123456", "class": "standard"},
]


@pytest.mark.parametrize(
    "key", ["key-zurich-0123456789abcdef012345", "key-member-0123456789abcdef012345"]
)
async def test_punctuated_tenant_and_share_group_names_are_served(key: str) -> None:
    """Names use the whole of their rule (gateway/tenancy/tenants.py: `-`, `_`, `.`); the
    prompt is not ASCII."""
    async with fleet(2, tenants=TENANTS) as f:
        async with httpx.AsyncClient(
            base_url=f.gateway_url, timeout=30, headers={"authorization": f"Bearer {key}"}
        ) as h:
            for stream in (False, True):
                r = await h.post(CHAT, content=chat_body(user("grüß dich"), stream=stream))
                assert r.status_code == 200, r.text
            r = await h.post(
                COMPLETIONS, content=json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2})
            )
            assert r.status_code == 200, r.text
            metrics = (await h.get("/metrics")).text
    assert "internal_error" not in errors_by_code(metrics)
    name = next(t["name"] for t in TENANTS if t["api_key"] == key)
    assert f'tenant="{name}"' in metrics  # the name is a label as it is


def test_namespaces_are_ascii_and_one_to_one() -> None:
    from gateway.serving.planner import namespace_of
    from gateway.tenancy.tenants import Tenant
    from routing.types import TenantClass

    names = ["é", "%C3%A9", "a b", "a%20b", "a\nb", "東京", "\ud800"]
    spaces = [namespace_of(MODEL, Tenant(n, TenantClass.STANDARD)) for n in names]
    assert all(s.isascii() and s.isprintable() and " " not in s for s in spaces)
    assert len(set(spaces)) == len(spaces)
    assert namespace_of(MODEL, Tenant("acme", TenantClass.STANDARD)) == f"{MODEL}|tenant:acme"


class _Tracebacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)


async def test_an_unexpected_error_is_a_500_envelope_logged_once() -> None:
    async with fleet(1) as f:
        handler = _Tracebacks()
        loggers = [logging.getLogger(n) for n in ("uvicorn.error", "uvicorn", "cachelane", "")]
        for logger in loggers:
            logger.addHandler(handler)
        real_plan = f.gw.planner.plan

        async def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("planted")

        try:
            f.gw.planner.plan = broken
            async with httpx.AsyncClient(base_url=f.gateway_url, timeout=30) as h:
                r = await h.post(CHAT, content=chat_body(user("x")))
                f.gw.planner.plan = real_plan
                ok = await h.post(CHAT, content=chat_body(user("x")))
                errors = errors_by_code((await h.get("/metrics")).text)
        finally:
            for logger in loggers:
                logger.removeHandler(handler)
    assert r.status_code == 500 and is_envelope(r.json())
    assert r.json()["error"]["code"] == "internal_error"
    assert ok.status_code == 200
    assert errors.get("internal_error") == 1
    # one record (the root logger sees cachelane's again: count distinct records)
    assert len({id(rec) for rec in handler.records}) == 1, [
        rec.getMessage() for rec in handler.records
    ]


async def test_large_bodies_are_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[tuple[int, bool]] = []
    real = body_module.parse_body

    def spy(raw: bytes, **kwargs: Any) -> dict[str, Any]:
        threads.append((len(raw), threading.current_thread() is threading.main_thread()))
        return real(raw, **kwargs)

    monkeypatch.setattr(body_module, "parse_body", spy)
    async with fleet(1) as f:
        async with httpx.AsyncClient(base_url=f.gateway_url, timeout=30) as h:
            small = {"model": MODEL, "prompt": "x", "max_tokens": 2}
            large = {**small, "user": "u" * 300_000}  # a 300 KB body, a short prompt
            for body in (small, large):
                r = await h.post(COMPLETIONS, content=json.dumps(body))
                assert r.status_code == 200, r.text
    assert len(threads) == 2
    (small_size, small_on_loop), (large_size, large_on_loop) = threads
    assert small_size <= body_module.OFFLOAD_BYTES < large_size
    assert small_on_loop and not large_on_loop


async def test_precise_mode_refuses_bad_token_ids_and_part_types(
    tokenizer_files: TinyTokenizerFiles,
) -> None:
    cases: list[tuple[str, str, dict[str, Any]]] = [
        # a full block (BS = 16 tokens) or more: the ids are hashed as 4-byte words
        ("negative token id", COMPLETIONS, {"prompt": [5] * 20 + [-1]}),
        ("token id past the vocabulary", COMPLETIONS, {"prompt": [5] * 20 + [VOCAB_SIZE + 10]}),
        ("token id past 32 bits", COMPLETIONS, {"prompt": [2**40] * 20}),
        ("batch of token ids, negative", COMPLETIONS, {"prompt": [[-5] * 20]}),
        ("text part with a number", CHAT, {"messages": [user([{"type": "text", "text": 3}])]}),
        ("tool_calls a number", CHAT, {"messages": [user("x", tool_calls=5)]}),
        ("content list of numbers", CHAT, {"messages": [user([1, 2])]}),
    ]
    async with precise_fleet(tokenizer_files, n=1) as f:
        async with httpx.AsyncClient(base_url=f.gateway_url, timeout=30) as h:
            failures = []
            for case, path, fields in cases:
                raw = json.dumps({"model": MODEL, "max_tokens": 2, **fields})
                r = await h.post(path, content=raw)
                if r.status_code != 400 or not is_envelope(r.json()):
                    failures.append(f"{case}: {r.status_code} {r.text[:200]}")
            ok = await h.post(COMPLETIONS, content=json.dumps({"model": MODEL, "prompt": [5, 6]}))
            assert ok.status_code == 200, ok.text
            errors = errors_by_code((await h.get("/metrics")).text)
    assert not failures, "\n".join(failures)
    assert "internal_error" not in errors


@pytest.mark.parametrize("field", ["messages", "content", "input"])
async def test_a_prompt_of_more_parts_than_the_bound_is_a_clear_400(field: str) -> None:
    """MAX_PROMPT_PARTS parts pass; one more is 400 `too_many_parts` naming the field, before
    any part is checked (the bound keeps the largest accepted body cheap to check)."""
    from gateway.http.request_schema import MAX_PROMPT_PARTS

    def body(parts: int) -> tuple[str, dict[str, Any]]:
        if field == "messages":
            turns = [{"role": "user", "content": "x"}] * parts
            return CHAT, {"model": MODEL, "messages": turns, "max_tokens": 1}
        if field == "content":  # one message, its content parts: the message counts one
            content = [{"type": "text", "text": "x"}] * (parts - 1)
            messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
            return CHAT, {"model": MODEL, "messages": messages, "max_tokens": 1}
        items = [{"role": "user", "content": "x"}] * parts
        return "/v1/responses", {"model": MODEL, "input": items, "max_output_tokens": 1}

    async with fleet(1) as f, httpx.AsyncClient(base_url=f.gateway_url, timeout=60) as h:
        path, at_bound = body(MAX_PROMPT_PARTS)
        assert (await h.post(path, json=at_bound)).status_code == 200
        path, over = body(MAX_PROMPT_PARTS + 1)
        r = await h.post(path, json=over)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "too_many_parts"
        assert error["param"] == ("input" if field == "input" else "messages")
