"""A client's JSON request body, parsed within bounds.

Python's json module accepts what the rest of the gateway (and the engines behind it) cannot
use: lone UTF-16 surrogates from `\\ud800` escapes (a str that cannot be encoded to UTF-8),
integers of any length (int() refuses more than 4300 digits, after the parse has spent the time),
NaN and Infinity (not JSON), and nesting as deep as the interpreter's recursion limit (any
recursive consumer after it, json.dumps or a chat template, then fails). parse_body() turns each of
these into a BodyError (a 400 for the app), with the limits from the config:

- `max_json_depth` (default 128, serde_json's recursion limit): arrays and objects nested deeper
  are refused;
- `max_number_chars` (default 1000, Jackson's StreamReadConstraints.DEFAULT_MAX_NUM_LEN): a number
  literal longer than that is refused before it is converted.

Bodies up to OFFLOAD_BYTES take a fast path: orjson parses them (it refuses lone surrogates,
NaN, infinities and invalid UTF-8 itself) unless a run of number characters is long enough to be
an integer beyond 64 bits (orjson would make it a float) or a number over `max_number_chars`;
their nesting is walked only when they have more brackets than `max_json_depth`. Every other
body is parsed by the bounded json parser below, which also gives each error its message.

Bodies above OFFLOAD_BYTES are parsed in a worker thread (see parse_body_async): the number hooks
run Python code, so the interpreter can hand the GIL back to the event loop during the parse and
an 8 MiB body does not stall the other streams for the whole of it.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

import anyio.to_thread
import orjson

DEFAULT_MAX_JSON_DEPTH = 128
# serde_json's default recursion limit ("nesting of JSON maps and arrays more than 128 layers
# deep": serde_json::error::Category RecursionLimitExceeded); tool schemas nest far less.
MAX_JSON_DEPTH_LIMIT = 512  # the recursive consumers after the parse need frames to spare (~1000)
DEFAULT_MAX_NUMBER_CHARS = 1000
# Jackson's StreamReadConstraints.DEFAULT_MAX_NUM_LEN (jackson-core 2.14+): the longest number
# literal a JSON parser hardened against hostile input accepts by default.
_INT64_DIGITS = 19
# The shortest integer literal that can exceed int64, which orjson parses as a float: a body with a
# run of number characters this long (or longer than max_number_chars) takes the bounded parser.
OFFLOAD_BYTES = 128 * 1024
# Above this a body is parsed off the event loop; below it the parse (< ~1 ms) costs less than the
# hand-off to a thread.


class BodyError(ValueError):
    """The body is not JSON the gateway accepts; `code` names why (the errors metric's label)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def parse_body(
    raw: bytes,
    *,
    max_depth: int = DEFAULT_MAX_JSON_DEPTH,
    max_number_chars: int = DEFAULT_MAX_NUMBER_CHARS,
) -> dict[str, Any]:
    """The body as a JSON object, or BodyError. Synchronous (see parse_body_async)."""
    # (above OFFLOAD_BYTES orjson would hold the GIL for the whole parse, stalling the loop)
    fast_path = len(raw) <= OFFLOAD_BYTES
    if fast_path and _number_run(min(_INT64_DIGITS, max_number_chars + 1)).search(raw) is None:
        try:
            fast = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # the parser below says what is wrong
        else:
            if isinstance(fast, dict):
                if raw.count(b"[") + raw.count(b"{") > max_depth:
                    _check(fast, max_depth)
                return fast

    def too_long(text: str) -> BodyError:
        return BodyError(
            f"a number in the request body is {len(text)} characters long; at most "
            f"{max_number_chars} are accepted",
            "number_too_large",
        )

    def parse_int(text: str) -> int:
        if len(text) > max_number_chars:
            raise too_long(text)
        return int(text)

    def parse_float(text: str) -> float:
        if len(text) > max_number_chars:
            raise too_long(text)
        value = float(text)
        if not math.isfinite(value):
            raise BodyError(f"the number {text[:40]} is out of range", "number_too_large")
        return value

    def parse_constant(text: str) -> Any:
        raise BodyError(f"{text} is not a JSON value", "invalid_json")

    try:
        body = json.loads(
            raw,
            parse_int=parse_int,
            parse_float=parse_float,
            parse_constant=parse_constant,
        )
    except RecursionError:
        raise _too_deep(max_depth) from None
    except UnicodeDecodeError as err:
        raise BodyError(f"the request body is not valid UTF-8: {err}", "invalid_json") from None
    except json.JSONDecodeError as err:
        raise BodyError(f"the request body is not valid JSON: {err}", "invalid_json") from None
    if not isinstance(body, dict):
        raise BodyError("the request body must be a JSON object", "invalid_json")
    _check(body, max_depth)
    return body


@functools.lru_cache(maxsize=8)
def _number_run(chars: int) -> re.Pattern[bytes]:
    """`chars` characters in a row that a JSON number literal may contain (strings match too:
    they only send the body to the bounded parser)."""
    return re.compile(rb"[-+.0-9eE]{%d}" % chars)


async def parse_body_async(
    raw: bytes,
    *,
    max_depth: int = DEFAULT_MAX_JSON_DEPTH,
    max_number_chars: int = DEFAULT_MAX_NUMBER_CHARS,
) -> dict[str, Any]:
    """parse_body(), in a worker thread when the body is larger than OFFLOAD_BYTES."""
    if len(raw) <= OFFLOAD_BYTES:
        return parse_body(raw, max_depth=max_depth, max_number_chars=max_number_chars)

    def parse() -> dict[str, Any]:
        return parse_body(raw, max_depth=max_depth, max_number_chars=max_number_chars)

    return await anyio.to_thread.run_sync(parse)


def _check(body: dict[str, Any], max_depth: int) -> None:
    """Nesting depth, and every string (keys too) encodable as UTF-8 (no lone surrogates).
    Iterative: a walk that recursed would itself be the stack overflow it guards against."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            raise _too_deep(max_depth)
        if isinstance(value, dict):
            for key in value:
                _check_text(key)
            items = value.values()
        else:
            items = value
        for item in items:
            if isinstance(item, str):
                _check_text(item)
            elif isinstance(item, dict | list):
                stack.append((item, depth + 1))


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode()
    except UnicodeEncodeError as err:
        raise BodyError(
            f"the request body has a lone UTF-16 surrogate ({err.object[err.start]!a}), which "
            "is not a Unicode character",
            "invalid_unicode",
        ) from None


def _too_deep(max_depth: int) -> BodyError:
    return BodyError(
        f"the request body nests arrays and objects more than {max_depth} levels deep",
        "json_too_deep",
    )
