"""The engine's usage of an answer, read from its JSON: a whole answer's body, or a streamed
answer's events, one SSE event at a time (gateway/serving/sse.py) as the bytes go by.

The usage object is OpenAI's: `usage.prompt_tokens`, `usage.completion_tokens`,
`usage.prompt_tokens_details.cached_tokens` (chat, completions, embeddings); the Responses API
calls them `input_tokens`, `output_tokens`, `input_tokens_details.cached_tokens`, and streams
them in its `response.completed` event (`response.usage`).

A stream carries usage only when the request asked (`stream_options.include_usage`): then one
chunk before `data: [DONE]` has `"choices": []` and the usage, and every other chunk
`"usage": null` (https://platform.openai.com/docs/api-reference/chat/create#chat-create-stream_options).
The proxy asks for it on the client's behalf (`ask_for_usage`) and strips that chunk from what
the client receives (`StreamReader(strip_usage=True)`), only when the client did not ask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.serving.sse import SseParser

DONE = b"[DONE]"
USAGE_ENDPOINTS = frozenset({"chat", "completions"})  # the ones with stream_options


@dataclass(frozen=True, slots=True)
class Usage:
    """What the engine said the answer used (None: it did not say); `raw` the JSON text that
    carried it (the rate limiter reads its total_tokens)."""

    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    raw: bytes


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def usage_from(obj: object, raw: bytes) -> Usage | None:
    """The usage in a decoded answer (or stream chunk, or Responses event), if it has one."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if usage is None and isinstance(obj.get("response"), dict):
        usage = obj["response"].get("usage")  # a Responses API event
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    return Usage(_int(prompt), _int(completion), cached, raw)


def usage_in(body: bytes) -> Usage | None:
    """The usage in a whole answer's JSON body, if it has one."""
    if b"_tokens" not in body:
        return None
    try:
        return usage_from(orjson.loads(body), body)
    except orjson.JSONDecodeError:
        return None


def ask_for_usage(endpoint: str, body: dict[str, Any]) -> bool:
    """Whether the proxy must add `stream_options.include_usage: true` upstream: a streamed
    chat or completions request whose client did not ask for the usage."""
    if endpoint not in USAGE_ENDPOINTS or body.get("stream") is not True:
        return False
    options = body.get("stream_options")
    return not (isinstance(options, dict) and options.get("include_usage") is True)


class StreamReader:
    """Reads a streamed answer's events on the side as its chunks go by.

    `relay(chunk, now_s)` returns the bytes to send on: the chunk itself, unchanged and at once,
    unless `strip_usage`: then the bytes of whole events, without the usage-only chunk, and an
    event's bytes are held until the event is complete (an event stream's reader dispatches
    nothing before then either). It keeps the usage, when the last event that carried
    tokens arrived (`last_token_s`: the end of a time per output token) and how many did
    (`token_events`: engines send one per step, a token or more, so a lower bound of the output
    a stream that ended without its usage has sent)."""

    def __init__(self, *, strip_usage: bool = False) -> None:
        self._parser = SseParser()
        self._strip = strip_usage
        self._held = bytearray()  # strip_usage: bytes not yet sent on
        self._held_from = 0  # the stream offset of _held's first byte
        self.usage: Usage | None = None
        self.last_token_s: float | None = None
        self.token_events = 0

    def relay(self, chunk: bytes, now_s: float) -> bytes:
        events = self._parser.feed(chunk)
        if not self._strip:
            for event in events:
                self._read(event.data, now_s)
            return chunk
        self._held += chunk
        out = bytearray()
        for event in events:
            usage_only = self._read(event.data, now_s)
            upto = event.end - self._held_from
            if not usage_only:
                out += self._held[:upto]
            del self._held[:upto]
            self._held_from = event.end
        return bytes(out)

    def rest(self) -> bytes:
        """At the stream's end: the bytes held back (an event the stream never completed)."""
        rest = bytes(self._held)
        self._held.clear()
        return rest

    def _read(self, data: bytes, now_s: float) -> bool:
        """Take one event's data; True if it is a usage-only chunk (`"choices": []`)."""
        if data == DONE:
            return False
        if b"_tokens" not in data:
            self._token(now_s)
            return False
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            self._token(now_s)
            return False
        usage = usage_from(obj, data)
        if usage is None:
            self._token(now_s)
            return False
        self.usage = usage
        return isinstance(obj, dict) and obj.get("choices") == []

    def _token(self, now_s: float) -> None:
        self.last_token_s = now_s
        self.token_events += 1
