"""How long a replica may take to begin its answer before the gateway tries the next one.

A streamed answer's first byte is its first token, due within a multiple of the request's own
estimated TTFT on that replica plus a margin (ESTIMATE_MULTIPLE, ESTIMATE_MARGIN_S), never past
the pool's hard cap, first_byte_timeout_s: a replica that stopped answering is left in seconds,
before a client's own timeout, while a long prompt's long estimate keeps its room. Once it has
begun, each chunk is due within idle_deadline_s of the previous one (a replica that stops
mid-stream, or whose connection breaks in a way the HTTP client does not notice, ends the stream
with an error event there).
A whole answer's first byte comes after the generation (vLLM's OpenAI server awaits the handler's
finished ChatCompletionResponse and sends it as one JSONResponse, status, headers and body
together: vllm/entrypoints/openai/api_server.py, create_chat_completion), so its bound is
that first token's plus the time its output takes at the slowest decode a healthy replica keeps
(pools[].min_decode_tokens_per_s). Its output is bounded by the request's max_tokens (or
max_completion_tokens, max_output_tokens), else by the model's context (max_model_len, as the
engine listed it in /v1/models); with neither, the proxy bounds the wait by upstream.read_timeout_s
itself (aiohttp's own read timeout does not fire on every broken answer), and its expiry is
retried on the next replica the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

from gateway.config import PoolConfig
from gateway.serving.upstream import UpstreamTimeout

OUTPUT_LIMIT_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
# Above any model's context (the longest are ~10M tokens, Llama 4 Scout's model card): a request
# asking for more is refused by the engine, so no deadline is derived from it (and a client's
# 10**400 never reaches float arithmetic)
MAX_OUTPUT_TOKENS = 10**7
# A first token this many times later than its estimate is not a queue the estimate missed but a
# replica that stopped: the p90 of the estimate's error is at most 25% in 19 of 21 runs of the
# estimate benchmark at 10x load (docs/bench/estimate.md), so 4x is far outside it
ESTIMATE_MULTIPLE = 4.0
# Added to it for what no estimate sees (an engine step under way, ~0.3 s at vLLM's default
# token budget; a connection set up; a GC pause): 3 s, so that a request that meets three stuck
# replicas in a row (the fault probe's hanging, paused and mid-stream-garbage ones,
# loadtest/bench/faults.py) still gets its answer from a fourth within a client's 15 s (Envoy's
# default route timeout); with 5 s one request of 200 there was lost that way
ESTIMATE_MARGIN_S = 3.0
# After its first token a stream's chunks come a step apart; a step that also carries other
# requests' prefill chunks is longer: ten tokens' time at the slowest decode a healthy replica
# keeps covers it (vLLM's default token budget of 8,192 prefills in ~0.3 s on an H200 at
# routing/cost.py's PREFILL_TOKENS_PER_S, a tenth of those ten tokens' 1 s at the default rate)
IDLE_TOKENS = 10


def output_limit_tokens(body: Mapping[str, Any], card: Mapping[str, Any] | None) -> int | None:
    """The most tokens the request may generate, if anything bounds it."""
    for field in OUTPUT_LIMIT_FIELDS:
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    limit = None if card is None else card.get("max_model_len")
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def idle_deadline_s(pool: PoolConfig) -> float:
    """Seconds a streamed answer may go without a chunk once it has begun: IDLE_TOKENS at the
    slowest decode a healthy replica keeps, plus the margin, within the pool's cap."""
    return min(
        pool.first_byte_timeout_s,
        IDLE_TOKENS / pool.min_decode_tokens_per_s + ESTIMATE_MARGIN_S,
    )


def first_token_deadline_s(pool: PoolConfig, estimate_s: float | None) -> float:
    """Seconds a replica has to send a request's first token, given its estimated TTFT there
    (None: no estimate, the pool's cap alone)."""
    if estimate_s is None:
        return pool.first_byte_timeout_s
    return min(pool.first_byte_timeout_s, ESTIMATE_MULTIPLE * estimate_s + ESTIMATE_MARGIN_S)


def first_byte_deadline_s(
    pool: PoolConfig,
    *,
    stream: bool,
    endpoint: str,
    body: Mapping[str, Any],
    card: Mapping[str, Any] | None,
    estimate_s: float | None = None,
) -> float | None:
    """Seconds the replica has to begin its answer (`estimate_s`: the request's estimated TTFT
    on it); None: no bound but the read timeout."""
    first_s = first_token_deadline_s(pool, estimate_s)
    if stream or endpoint == "embeddings":  # an embedding has no decode
        return first_s
    limit = output_limit_tokens(body, card)
    if limit is None or limit > MAX_OUTPUT_TOKENS:
        return None
    return first_s + limit / pool.min_decode_tokens_per_s


async def chunks_within(chunks: AsyncIterator[bytes], idle_s: float) -> AsyncIterator[bytes]:
    """`chunks`, each read within `idle_s` (the time the consumer holds one does not count);
    UpstreamTimeout when a read takes longer."""
    it = aiter(chunks)
    while True:
        try:
            async with asyncio.timeout(idle_s):
                chunk = await anext(it)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise UpstreamTimeout(f"no chunk in {idle_s:.3g} s") from None
        yield chunk
