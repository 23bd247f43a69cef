"""Calls through the real `openai` client that several integration tests make alike."""

from __future__ import annotations

from typing import Any

import openai
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionChunk


async def streamed_chunks(
    client: openai.AsyncOpenAI, model: str, messages: Any, max_tokens: int = 4, **extra: Any
) -> list[ChatCompletionChunk]:
    """Streams a chat completion that asks for usage (include_usage) and reads it to the end: its
    chunks. `extra` goes to the create call as is (extra_headers, ...)."""
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    return [chunk async for chunk in stream]


async def streamed_usage(
    client: openai.AsyncOpenAI, model: str, messages: Any, **extra: Any
) -> CompletionUsage | None:
    """Streams a 4-token chat completion (streamed_chunks) and returns the usage its last chunk
    carries (None where none did)."""
    usage = None
    for chunk in await streamed_chunks(client, model, messages, **extra):
        usage = chunk.usage or usage
    return usage
