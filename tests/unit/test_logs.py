"""gateway/telemetry/logs.py: request id cleaning, the request id filter, the two log formats."""

from __future__ import annotations

import json
import logging

import pytest

from gateway.telemetry.logs import (
    _BARE_VALUE,
    JsonFormatter,
    RequestIdFilter,
    TextFormatter,
    clean_request_id,
    key_values,
    upstream_headers,
)


def record(
    msg: str = "hello %s", args: tuple[object, ...] = ("world",), **extra: object
) -> logging.LogRecord:
    r = logging.LogRecord("cachelane.test", logging.INFO, __file__, 1, msg, args, None)
    for k, v in extra.items():
        setattr(r, k, v)
    return r


def test_a_safe_request_id_is_kept_and_anything_else_replaced() -> None:
    for kept in ("abc", "A-1_2.3:4", "x" * 128):
        assert clean_request_id(kept) == kept
    for bad in (None, "", "x" * 129, "a b", "a\nb", "é", "a;b", "a/b"):
        new = clean_request_id(bad)
        assert len(new) == 32 and int(new, 16) >= 0
    assert clean_request_id(None) != clean_request_id(None)


def test_outside_a_request_nothing_is_forwarded_and_no_id_is_set() -> None:
    assert upstream_headers() == {}
    r = record()
    assert RequestIdFilter().filter(r)
    assert r.request_id is None  # type: ignore[attr-defined]


def test_json_lines_carry_the_message_the_id_and_the_access_fields() -> None:
    line = json.loads(JsonFormatter().format(record(request_id="r1")))
    assert line["msg"] == "hello world" and line["request_id"] == "r1"
    assert line["level"] == "INFO" and line["logger"] == "cachelane.test"
    assert line["ts"].endswith("+00:00")
    access = {"request_id": "r2", "method": "GET", "path": "/v1/models", "status": 200, "x": None}
    line = json.loads(JsonFormatter().format(record("ignored", (), access=access)))
    assert line["msg"] == "GET /v1/models 200"
    assert line["request_id"] == "r2" and line["status"] == 200 and line["x"] is None


def test_json_lines_carry_a_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        r = record(exc_info=sys.exc_info())
    line = json.loads(JsonFormatter().format(r))
    assert "ValueError: boom" in line["exc"]


def test_text_lines_end_with_the_request_id() -> None:
    assert TextFormatter().format(record(request_id="r1")).endswith("hello world request_id=r1")
    assert TextFormatter().format(record(request_id=None)).endswith("hello world")


FORGED = "x\n2026-12-04 18:31:00,000\tWARNING\tcachelane.tenants:\tforged"
HOSTILE = [
    FORGED,
    "a\rb",
    "a\x00b",
    "\x1b[31mred",
    "rlo\u202eevil",
    "zw\u200bsp",
    "ls\u2028x",
    'q"=',
]


@pytest.mark.parametrize("value", HOSTILE, ids=range(len(HOSTILE)))
def test_every_access_value_is_one_escaped_token(value: str) -> None:
    fields = {"path": value, "tenant": value, "status": 400}
    text = TextFormatter().format(record(key_values(fields), (), access=fields))
    assert len(text.splitlines()) == 1, text
    assert text.isascii() and text.isprintable(), text
    assert text.endswith(f"path={json.dumps(value)} tenant={json.dumps(value)} status=400")


@pytest.mark.parametrize("value", HOSTILE, ids=range(len(HOSTILE)))
def test_every_other_message_is_one_line(value: str) -> None:
    text = TextFormatter().format(record("asked for %s", (value,), request_id="r1"))
    assert len(text.splitlines()) == 1, text
    assert "\t" not in text and "\x1b" not in text and "\u202e" not in text
    assert text.endswith(" request_id=r1")


def test_a_traceback_follows_indented_and_escaped() -> None:
    try:
        raise ValueError(FORGED)
    except ValueError:
        import sys

        r = record(exc_info=sys.exc_info())
    lines = TextFormatter().format(r).splitlines()
    assert lines[0].endswith("hello world")
    assert all(line.startswith(TextFormatter.TRACE_INDENT) for line in lines[1:]), lines
    assert "\t" not in "".join(lines)


@pytest.mark.parametrize("value", HOSTILE, ids=range(len(HOSTILE)))
def test_json_lines_stay_one_json_object(value: str) -> None:
    text = JsonFormatter().format(record("asked for %s", (value,), request_id="r1"))
    assert len(text.splitlines()) == 1
    assert json.loads(text)["msg"] == f"asked for {value}"


def test_plain_values_stay_bare() -> None:
    assert key_values({"a": "/v1/chat/completions", "b": None, "c": 3.5, "d": ""}) == (
        'a=/v1/chat/completions b=- c=3.5 d=""'
    )


@pytest.mark.parametrize("value", [0, -3, 7.25, 1e300, -2.5e-7, float("nan"), float("inf")])
def test_numbers_are_written_as_str_writes_them_and_stay_bare(value: float) -> None:
    line = key_values({"n": value})
    assert line == f"n={value}"
    assert _BARE_VALUE.fullmatch(line.removeprefix("n="))  # what the pattern would have said


def test_the_access_line_takes_usage_only_from_the_parsed_usage() -> None:
    """A `prompt_tokens` outside the answer's usage (an engine's own extra field) is not its
    usage: the access record's token counts come from the settled, parsed usage (note_usage)
    alone."""
    from gateway.telemetry.logs import AccessWatch, note_usage

    watch = AccessWatch({"type": "http", "method": "POST", "path": "/v1/chat/completions"})
    try:
        watch.seen({"type": "http.response.start", "status": 200, "headers": []})
        content = b'{"choices": [], "engine_stats": {"prompt_tokens": 999}}'
        watch.seen({"type": "http.response.body", "body": content})
        before = watch.access.prompt_tokens
        note_usage(12, 4)
        assert before is None
        assert (watch.access.prompt_tokens, watch.access.cached_tokens) == (12, 4)
    finally:
        watch.close()
