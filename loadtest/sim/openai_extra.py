"""The simulator's /v1/embeddings and /v1/responses bodies, shaped as vLLM's (its OpenAI-compatible
server serves both): embeddings are deterministic unit vectors of the input's hash, as floats or
base64 of little-endian float32 (`encoding_format`, which the openai SDK sets to base64); a
response is the Responses API object, or its SSE events when streamed."""

from __future__ import annotations

import base64
import json
import math
import struct
import uuid
from typing import Any

import xxhash

from loadtest.sim.protocol import now_s

EMBEDDING_DIM = 16


def embedding(text: str, dim: int = EMBEDDING_DIM) -> list[float]:
    raw = [xxhash.xxh3_64_intdigest(f"{i}:{text}".encode()) / 2**64 - 0.5 for i in range(dim)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]


def embeddings_response(
    model: str, inputs: list[str], encoding_format: str, prompt_tokens: int
) -> dict[str, Any]:
    data = []
    for i, text in enumerate(inputs):
        vector = embedding(text)
        value: list[float] | str = vector
        if encoding_format == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"index": i, "object": "embedding", "embedding": value})
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": now_s(),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Chat usage as the Responses API's (input/output tokens, cached in input_tokens_details)."""
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


class ResponseWriter:
    """One Responses API answer: the whole object, or its stream of events."""

    def __init__(self, model: str, body: dict[str, Any]) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.body = body
        self.created = now_s()
        self.seq = 0

    def message(self, text: str, status: str = "completed") -> dict[str, Any]:
        content: list[dict[str, Any]] = [
            {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
        ]
        return {
            "type": "message",
            "id": self.msg_id,
            "role": "assistant",
            "status": status,
            "content": content if status == "completed" else [],
        }

    def response(
        self, text: str | None, usage: dict[str, Any] | None, status: str = "completed"
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "instructions": self.body.get("instructions"),
            "max_output_tokens": self.body.get("max_output_tokens"),
            "metadata": self.body.get("metadata"),
            "output": [] if text is None else [self.message(text)],
            "parallel_tool_calls": True,
            "temperature": self.body.get("temperature", 1.0),
            "tool_choice": "auto",
            "tools": [],
            "top_p": self.body.get("top_p", 1.0),
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "error": None,
            "incomplete_details": None,
            "usage": None if usage is None else responses_usage(usage),
        }

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        data = json.dumps(payload, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def opening(self) -> list[bytes]:
        start = self.response(None, None, "in_progress")
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self.event("response.created", response=start),
            self.event("response.in_progress", response=start),
            self.event(
                "response.output_item.added", output_index=0, item=self.message("", "in_progress")
            ),
            self.event(
                "response.content_part.added",
                item_id=self.msg_id,
                output_index=0,
                content_index=0,
                part=part,
            ),
        ]

    def delta(self, text: str) -> bytes:
        return self.event(
            "response.output_text.delta",
            item_id=self.msg_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def closing(self, text: str, usage: dict[str, Any]) -> list[bytes]:
        part = {"type": "output_text", "text": text, "annotations": []}
        common = {"item_id": self.msg_id, "output_index": 0, "content_index": 0}
        return [
            self.event("response.output_text.done", text=text, logprobs=[], **common),
            self.event("response.content_part.done", part=part, **common),
            self.event("response.output_item.done", output_index=0, item=self.message(text)),
            self.event("response.completed", response=self.response(text, usage)),
        ]
