"""Chained block hashes of a prompt.

The text is cut into fixed-size blocks (block_size_tokens * CHARS_PER_TOKEN characters in
approximate mode); only full blocks are hashed, because engines cache only full blocks.
Block i's hash is xxh3_64(block_i, seed=hash_{i-1}), with hash_{-1} = root_seed(namespace), so a
hash identifies the whole prefix up to and including its block, and two prompts share hash i
exactly when they share their first i+1 blocks. The namespace (model, tenant share group) keeps
prefixes of different models or isolated tenants apart.
"""

from __future__ import annotations

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
    end = len(text) - step + 1
    if not text.isascii():
        # Cut on characters, not bytes, so a boundary never falls inside a UTF-8 sequence.
        blocks = [text[i : i + step].encode("utf-8", "surrogatepass") for i in range(0, end, step)]
        return _chain(blocks, root_seed(namespace))
    # ASCII: a character is a byte, so the text is encoded once and hashed in one pass
    data = text.encode("ascii")
    hash_ = xxhash.xxh3_64_intdigest
    out: list[int] = []
    append = out.append
    h = root_seed(namespace)
    for i in range(0, end, step):
        h = hash_(data[i : i + step], h)
        append(h)
    return out


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
