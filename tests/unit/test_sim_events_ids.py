"""The simulator's KV events without a tokenizer carry the token ids its /render endpoints give,
so a router that matches events by token ids (vllm-router's kv_aware) sees the prompts' sharing."""

from __future__ import annotations

from typing import Any

from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.engine import SimEngine
from loadtest.sim.protocol import fake_token_ids


def test_events_carry_the_render_ids_of_each_block() -> None:
    seen: list[Any] = []
    spec = SimReplicaSpec(name="sim-0", port=1, hbm_capacity_tokens=10_000)
    engine = SimEngine(spec, None, events=seen.extend)
    text = "The quick brown fox jumps over the lazy dog. " * 10  # 450 characters, 7 full blocks
    prompt = engine.prompt(text, "m")
    assert prompt.token_ids == tuple(fake_token_ids(text))
    engine.publish_placement(prompt, list(prompt.hashes), [], [], [])
    [stored] = seen
    bs = spec.block_size_tokens
    assert stored.token_ids == tuple(fake_token_ids(text)[: len(prompt.hashes) * bs])
    assert len(stored.block_hashes) == len(prompt.hashes) == 7


def test_without_events_no_ids_are_computed() -> None:
    engine = SimEngine(SimReplicaSpec(name="sim-0", port=1), None)
    assert engine.prompt("some prompt text " * 8, "m").token_ids == ()
