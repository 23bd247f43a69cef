"""Calls through the real `openai` client that several integration tests make alike."""

from __future__ import annotations

from typing import Any

import openai
from openai.types import CompletionUsage


async def streamed_usage(
    client: openai.AsyncOpenAI, model: str, messages: Any, **extra: Any
) -> CompletionUsage | None:
    """Streams a 4-token chat completion that asks for usage (include_usage), reads it to the
    end and returns the usage its last chunk carries (None where none did). `extra` goes to the
    create call as is (extra_headers, ...)."""
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
    return usage
