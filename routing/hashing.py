"""Chained block hashes of a prompt.

The text is cut into fixed-size blocks (block_size_tokens * CHARS_PER_TOKEN characters in
approximate mode); only full blocks are hashed, because engines cache only full blocks.
Block i's hash is xxh3_64(block_i, seed=hash_{i-1}), with hash_{-1} = root_seed(namespace), so a
hash identifies the whole prefix up to and including its block, and two prompts share hash i
exactly when they share their first i+1 blocks. The namespace (model, tenant share group) keeps
prefixes of different models or isolated tenants apart.
"""

from __future__ import annotations

from collections import OrderedDict

import xxhash

from routing.prompt import CHARS_PER_TOKEN

DEFAULT_BLOCK_SIZE_TOKENS = 16  # vLLM's default --block-size (vllm/config/cache.py: block_size=16)


def root_seed(namespace: str) -> int:
    return xxhash.xxh3_64_intdigest(namespace.encode())


def block_hashes(
    text: str, *, block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS, namespace: str = ""
) -> list[int]:
    """Chained xxh3_64 hashes of every full block of `text`."""
    step = block_size_tokens * CHARS_PER_TOKEN
    data = text.encode("ascii") if text.isascii() else None
    return _chain_text(text, data, 0, len(text), step, root_seed(namespace))


def _chain_text(
    text: str, data: bytes | None, start: int, stop: int, step: int, seed: int
) -> list[int]:
    """Chained hashes of the full blocks of text[start:stop], continuing from `seed`. `data` is
    the text's ASCII bytes, or None when it is not ASCII: then the blocks are cut on characters,
    not bytes, so a boundary never falls inside a UTF-8 sequence."""
    end = stop - step + 1
    if data is None:
        blocks = [
            text[i : i + step].encode("utf-8", "surrogatepass") for i in range(start, end, step)
        ]
        return _chain(blocks, seed)
    # ASCII: a character is a byte, so the text was encoded once and is hashed in one pass
    hash_ = xxhash.xxh3_64_intdigest
    out: list[int] = []
    append = out.append
    h = seed
    for i in range(start, end, step):
        h = hash_(data[i : i + step], h)
        append(h)
    return out


SPAN_BLOCKS = 32
# PrefixHasher's unit: 32 blocks (512 tokens, 2 KiB of ASCII text). One xxh3 call per span finds
# a span hashed before; a new tail re-hashes at most one span's blocks more than it must.
SPAN_CACHE_SPANS = 4_096
# ~1.4 KiB per span (32 hashes and their list), ~6 MiB in all: 2M tokens of distinct prefix text.


class PrefixHasher:
    """block_hashes() that remembers the text it has hashed: the same hashes, less work.

    Most of a prompt is a prefix another request sent (the system prompt, the earlier turns, a
    shared document), and at one xxh3 call per 16-token block hashing an 8k-token prompt was a
    third of a routing decision. The text is cut into spans of SPAN_BLOCKS blocks, chained like
    the blocks (span j's hash is xxh3_64 of its bytes seeded with span j-1's, the first seeded
    with the namespace's root seed), so a span's hash names the whole prefix up to its end and
    the block hashes inside it are a function of it; they are kept under it in an LRU. A span not
    seen before is hashed block by block and kept; the tail shorter than a span always is."""

    def __init__(self, max_spans: int = SPAN_CACHE_SPANS) -> None:
        self._max_spans = max_spans
        # tuples of ints: the cyclic GC stops tracking them, so the cache does not add a tracked
        # object per span to every full collection (and make them more frequent)
        self._spans: OrderedDict[tuple[int, int], tuple[int, ...]] = OrderedDict()

    def block_hashes(
        self, text: str, *, block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS, namespace: str = ""
    ) -> list[int]:
        step = block_size_tokens * CHARS_PER_TOKEN
        span_chars = step * SPAN_BLOCKS
        data = text.encode("ascii") if text.isascii() else None
        hash_ = xxhash.xxh3_64_intdigest
        spans = self._spans
        out: list[int] = []
        block_seed = span_seed = root_seed(namespace)
        whole = len(text) - len(text) % span_chars
        for start in range(0, whole, span_chars):
            stop = start + span_chars
            span = (
                data[start:stop]
                if data is not None
                else text[start:stop].encode("utf-8", "surrogatepass")
            )
            span_seed = hash_(span, span_seed)
            key = (span_seed, step)
            hashes = spans.get(key)
            if hashes is None:
                hashes = tuple(_chain_text(text, data, start, stop, step, block_seed))
                spans[key] = hashes
                if len(spans) > self._max_spans:
                    spans.popitem(last=False)
            else:
                spans.move_to_end(key)
            out += hashes
            block_seed = hashes[-1]
        out += _chain_text(text, data, whole, len(text), step, block_seed)
        return out

    def __len__(self) -> int:
        return len(self._spans)


def token_block_hashes(
    token_ids: list[int], *, block_size_tokens: int, namespace: str = ""
) -> list[int]:
    """Chained hashes over token ids (precise mode), same chaining as block_hashes."""
    return chain_token_blocks(
        token_ids, block_size_tokens=block_size_tokens, seed=root_seed(namespace)
    )


def chain_token_blocks(token_ids: list[int], *, block_size_tokens: int, seed: int) -> list[int]:
    """Chained hashes of the full blocks of token_ids, continuing a chain whose last hash is
    `seed` (a parent block's hash, or root_seed(namespace) for a prompt's first block)."""
    blocks = [
        b"".join(
            t.to_bytes(4, "little", signed=False) for t in token_ids[i : i + block_size_tokens]
        )
        for i in range(0, len(token_ids) - block_size_tokens + 1, block_size_tokens)
    ]
    return _chain(blocks, seed)


def _chain(blocks: list[bytes], seed: int) -> list[int]:
    out: list[int] = []
    h = seed
    for block in blocks:
        h = xxhash.xxh3_64_intdigest(block, seed=h)
        out.append(h)
    return out
