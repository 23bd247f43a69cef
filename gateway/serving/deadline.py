"""How long a replica may take to begin its answer before the gateway tries the next one.

A streamed answer's first byte is its first token: the pool's first_byte_timeout_s bounds it.
A whole answer's first byte comes after the generation (vLLM's OpenAI server awaits the handler's
finished ChatCompletionResponse and sends it as one JSONResponse, status, headers and body
together: vllm/entrypoints/openai/api_server.py, create_chat_completion), so its bound is
first_byte_timeout_s plus the time its output takes at the slowest decode a healthy replica keeps
(pools[].min_decode_tokens_per_s). Its output is bounded by the request's max_tokens (or
max_completion_tokens, max_output_tokens), else by the model's context (max_model_len, as the
engine listed it in /v1/models); with neither, only upstream.read_timeout_s bounds the wait (and
its expiry is retried on the next replica the same way).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.config import PoolConfig

OUTPUT_LIMIT_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
# Above any model's context (the longest are ~10M tokens, Llama 4 Scout's model card): a request
# asking for more is refused by the engine, so no deadline is derived from it (and a client's
# 10**400 never reaches float arithmetic)
MAX_OUTPUT_TOKENS = 10**7


def output_limit_tokens(body: Mapping[str, Any], card: Mapping[str, Any] | None) -> int | None:
    """The most tokens the request may generate, if anything bounds it."""
    for field in OUTPUT_LIMIT_FIELDS:
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    limit = None if card is None else card.get("max_model_len")
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def first_byte_deadline_s(
    pool: PoolConfig,
    *,
    stream: bool,
    endpoint: str,
    body: Mapping[str, Any],
    card: Mapping[str, Any] | None,
) -> float | None:
    """Seconds the replica has to begin its answer; None: no bound but the read timeout."""
    if stream or endpoint == "embeddings":  # an embedding has no decode
        return pool.first_byte_timeout_s
    limit = output_limit_tokens(body, card)
    if limit is None or limit > MAX_OUTPUT_TOKENS:
        return None
    return pool.first_byte_timeout_s + limit / pool.min_decode_tokens_per_s
