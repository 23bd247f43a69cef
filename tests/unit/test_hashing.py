import random

import pytest

from routing.hashing import (
    SPAN_BLOCKS,
    PrefixHasher,
    block_hashes,
    root_seed,
    token_block_hashes,
)
from routing.prompt import CHARS_PER_TOKEN

FOX = "The quick brown fox jumps over the lazy dog. " * 4  # 180 characters

# Golden vectors: these must never change, or every deployed index and simulator disagrees.
GOLDEN = [
    16991081147463960910,
    613265764496887236,
    6281751103626978119,
    18176212630639570847,
    6601835639003392647,
    14603925123407871968,
    11658638352141496796,
    15273759000182621917,
    14939262907487940086,
    4624259503839026097,
    8102471814420124981,
]


def test_golden_vectors() -> None:
    assert block_hashes(FOX, block_size_tokens=4, namespace="m") == GOLDEN


def test_golden_non_ascii() -> None:
    assert block_hashes("é" * 32, block_size_tokens=4) == [
        18052844550683504218,
        9458367940633176513,
    ]


@pytest.mark.parametrize(
    ("chars", "block_tokens", "blocks"),
    [(0, 16, 0), (63, 16, 0), (64, 16, 1), (127, 16, 1), (128, 16, 2), (1000, 4, 62)],
    ids=["empty", "one-short", "exact-one", "partial-tail-dropped", "two", "small-blocks"],
)
def test_only_full_blocks_are_hashed(chars: int, block_tokens: int, blocks: int) -> None:
    assert len(block_hashes("x" * chars, block_size_tokens=block_tokens)) == blocks
    assert block_tokens * CHARS_PER_TOKEN * blocks <= chars


def test_chain_identifies_the_whole_prefix() -> None:
    a = block_hashes("A" * 64 + "B" * 64, block_size_tokens=16)
    b = block_hashes("C" * 64 + "B" * 64, block_size_tokens=16)
    assert a[1] != b[1], "same second block after a different first block must differ"


def test_shared_prefix_shares_leading_hashes() -> None:
    base = FOX * 3
    a = block_hashes(base + "tail one", block_size_tokens=4)
    b = block_hashes(base + "another tail entirely", block_size_tokens=4)
    shared = len(base) // (4 * CHARS_PER_TOKEN)
    assert a[:shared] == b[:shared]


def test_namespace_isolates() -> None:
    assert block_hashes(FOX, namespace="a") != block_hashes(FOX, namespace="b")
    assert root_seed("a") != root_seed("b")


def test_token_block_hashes_chain() -> None:
    ids = list(range(100))
    h = token_block_hashes(ids, block_size_tokens=32)
    assert len(h) == 3
    assert token_block_hashes(ids[:64], block_size_tokens=32) == h[:2]


def _texts(seed: int) -> list[str]:
    """Prompts that share prefixes of every length (span-aligned and not), ASCII or not."""
    rng = random.Random(seed)
    alphabet = "abcdefgh ijklmnop\n" + ("é中😀" if seed % 2 else "")
    base = "".join(rng.choice(alphabet) for _ in range(3 * SPAN_BLOCKS * 64 + 100))
    texts = [base[: rng.randrange(len(base))] for _ in range(30)]
    texts += [t + "".join(rng.choice(alphabet) for _ in range(rng.randrange(300))) for t in texts]
    return [*texts, base, base, "", "x" * 63, "\ud800" * 200]  # a lone surrogate, as JSON allows


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_spans", [1, 3, 4096])
def test_prefix_hasher_gives_block_hashes_exactly(seed: int, max_spans: int) -> None:
    """Whatever it remembers (or had to forget), the hashes are block_hashes()'s."""
    hasher = PrefixHasher(max_spans=max_spans)
    for text in _texts(seed):
        for block_tokens, namespace in [(16, "m"), (16, "other"), (4, "m")]:
            expected = block_hashes(text, block_size_tokens=block_tokens, namespace=namespace)
            got = hasher.block_hashes(text, block_size_tokens=block_tokens, namespace=namespace)
            assert got == expected
    assert len(hasher) <= max_spans


def test_prefix_hasher_remembers_shared_spans_only() -> None:
    hasher = PrefixHasher()
    span_chars = SPAN_BLOCKS * 16 * CHARS_PER_TOKEN
    shared = "s" * (2 * span_chars)
    hasher.block_hashes(shared + "a" * span_chars)
    assert len(hasher) == 3
    hasher.block_hashes(shared + "b" * span_chars + "tail")  # the shared two spans are reused
    assert len(hasher) == 4
