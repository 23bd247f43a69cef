"""prefix_hash: rendezvous hashing of the prompt's first PREFIX_KEY_BLOCKS blocks, with bounded
load: a replica above LOAD_BOUND x the mean in-flight count is skipped for the next one in its
hash order (Mirrokni et al., "Consistent Hashing with Bounded Loads", 2018). A baseline."""

from __future__ import annotations

import math

import xxhash

from routing.policies.base import Choice, Policy, Reason, RouteRequest, RoutingPolicy

PREFIX_KEY_BLOCKS = 4
# prefix_hash keys on the first 4 blocks (64 tokens at block size 16): long enough to separate
# system prompts, short enough that every turn of one conversation maps to the same key.

LOAD_BOUND = 1.25
# Bounded-load factor c = 1.25, the value Mirrokni et al. evaluate and Vimeo's production use
# of bounded-load consistent hashing (HAProxy hash-balance-factor 125).


class PrefixHash(RoutingPolicy):
    policy = Policy.PREFIX_HASH

    def rank(self, choice: Choice) -> tuple[tuple[str, ...], Reason]:
        key_bytes = prefix_key(choice.request)
        candidates = choice.candidates
        by_weight = sorted(
            candidates,
            key=lambda c: xxhash.xxh3_64_intdigest(
                key_bytes, seed=xxhash.xxh3_64_intdigest(c.name.encode())
            ),
            reverse=True,
        )
        total = sum(c.load.in_flight for c in candidates) + 1  # counting this request
        bound = math.ceil(LOAD_BOUND * total / len(candidates))
        within = [c for c in by_weight if c.load.in_flight + 1 <= bound]
        order = within + [c for c in by_weight if c not in within]
        reason = Reason.PREFIX_HASH if order[0] is by_weight[0] else Reason.PREFIX_HASH_SPILL
        return tuple(c.name for c in order), reason


def prefix_key(request: RouteRequest) -> bytes:
    """What the prompt hashes to: the hash of its first PREFIX_KEY_BLOCKS blocks."""
    hashes = request.hashes
    # a prompt shorter than one block has no hash; its length is the only key left
    key = hashes[min(PREFIX_KEY_BLOCKS, len(hashes)) - 1] if hashes else request.prompt_tokens
    return key.to_bytes(8, "little")
