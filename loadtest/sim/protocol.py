"""OpenAI wire shapes the simulated replica speaks: responses, stream chunks, usage, errors, render.

Shapes follow OpenAI's API reference (chat.completion, chat.completion.chunk, text_completion and
the error envelope) and vLLM's /render endpoints, which return vLLM's GenerateRequest model (its
scale-out serving protocol): /v1/chat/completions/render one, /v1/completions/render a list.
"""

from __future__ import annotations

import json
import time
import uuid
from enum import StrEnum
from typing import Any

import xxhash

from routing.prompt import CHARS_PER_TOKEN

FILLER_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit")

VOCAB_SIZE = 128_256  # Llama-3.1's vocabulary (meta-llama/Llama-3.1-8B config.json: vocab_size)

SSE_DONE = b"data: [DONE]\n\n"


class Kind(StrEnum):
    CHAT = "chat"
    COMPLETION = "completion"


class ApiError(Exception):
    """An error the client sees as OpenAI's envelope with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None,
        param: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}


def token_text(i: int) -> str:
    """The i-th generated token: a filler word with its leading space (about one token)."""
    return " " + FILLER_WORDS[i % len(FILLER_WORDS)]


def fake_token_ids(text: str) -> list[int]:
    """Deterministic stand-in token ids, one per CHARS_PER_TOKEN characters (prefix-stable)."""
    return [
        xxhash.xxh32_intdigest(text[i : i + CHARS_PER_TOKEN].encode("utf-8", "surrogatepass"))
        % VOCAB_SIZE
        for i in range(0, len(text), CHARS_PER_TOKEN)
    ]


def new_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind is Kind.CHAT else "cmpl-") + uuid.uuid4().hex


def now_s() -> int:
    return int(time.time())


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    timing: dict[str, float] | None = None,
) -> dict[str, Any]:
    """OpenAI's usage object; `timing` is the simulator's own extension (SIM_TIMING_KEY: where
    the prompt's KV came from and how long the request waited for the prefill), which the
    benchmarks read to check each term of the gateway's estimate on its own."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if timing is not None:
        out[SIM_TIMING_KEY] = timing
    return out


SIM_TIMING_KEY = "cachelane_sim"


def response(
    kind: Kind, rid: str, model: str, text: str, finish_reason: str, usage_: dict[str, Any]
) -> dict[str, Any]:
    """A whole (non-streamed) chat.completion or text_completion."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if kind is Kind.CHAT:
        choice["message"] = {"role": "assistant", "content": text, "refusal": None}
        obj = "chat.completion"
    else:
        choice["text"] = text
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": now_s(),
        "model": model,
        "choices": [choice],
        "usage": usage_,
    }


class ChunkWriter:
    """Serialises one stream's SSE events: role (chat), content, finish, usage, [DONE]."""

    def __init__(self, kind: Kind, model: str, *, include_usage: bool) -> None:
        self.kind = kind
        self.id = new_id(kind)
        self.model = model
        self.created = now_s()
        self.include_usage = include_usage

    def role(self) -> bytes:
        return self._event({"role": "assistant", "content": ""}, None)

    def content(self, text: str, finish_reason: str | None = None) -> bytes:
        return self._event({"content": text} if self.kind is Kind.CHAT else text, finish_reason)

    def finish(self, finish_reason: str) -> bytes:
        """Chat's closing chunk: an empty delta with the finish reason."""
        return self._event({}, finish_reason)

    def usage(self, usage_: dict[str, Any]) -> bytes:
        return sse({**self._base(), "choices": [], "usage": usage_})

    def _event(self, delta: dict[str, Any] | str, finish_reason: str | None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if isinstance(delta, dict):
            choice["delta"] = delta
        else:
            choice["text"] = delta
        chunk: dict[str, Any] = {**self._base(), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    def _base(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind is Kind.CHAT else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def render_result(
    kind: Kind, token_ids: list[int], model: str, body: dict[str, Any], max_tokens: int
) -> dict[str, Any]:
    """vLLM's GenerateRequest for one rendered prompt."""
    return {
        "request_id": new_id(kind),
        "token_ids": token_ids,
        "features": None,
        "sampling_params": {
            "n": 1,
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "max_tokens": max_tokens,
        },
        "model": model,
        "stream": bool(body.get("stream", False)),
        "stream_options": body.get("stream_options"),
        "cache_salt": body.get("cache_salt"),
        "priority": body.get("priority", 0),
        "kv_transfer_params": None,
    }
