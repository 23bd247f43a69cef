import functools
import itertools
import random
from typing import Any

import pytest

from loadtest.workloads import traces
from loadtest.workloads.traces import (
    MAX_TOKENS,
    SHAPES,
    ServiceBound,
    TraceRecord,
    generate,
    ideal_hits,
    shape_trace,
    words_text,
)
from routing.prompt import CHARS_PER_TOKEN, approx_tokens

RATE_PER_S = 10.0
DURATION_S = 20.0


@functools.cache
def _trace(shape: str, seed: int = 1) -> list[TraceRecord]:
    return shape_trace(shape, rate_per_s=RATE_PER_S, duration_s=DURATION_S, seed=seed)


@pytest.mark.parametrize("shape", [*SHAPES, "mixed"])
def test_same_seed_same_trace(shape: str) -> None:
    def fresh(seed: int) -> list[TraceRecord]:
        return shape_trace(shape, rate_per_s=RATE_PER_S, duration_s=DURATION_S, seed=seed)

    assert fresh(7) == fresh(7)
    assert fresh(7) != fresh(8)


@pytest.mark.parametrize("shape", [*SHAPES, "mixed"])
def test_records_are_well_formed_and_ordered(shape: str) -> None:
    trace = _trace(shape)
    assert trace, "a 20 s trace at 10/s has requests"
    times = [r["t_s"] for r in trace]
    assert times == sorted(times)
    assert times[0] >= 0 and times[-1] < DURATION_S
    for r in trace:
        assert r["max_tokens"] == MAX_TOKENS
        if r["endpoint"] == "chat":
            assert r["messages"] and "prompt" not in r
        else:
            assert r["endpoint"] == "completions" and r["prompt"] and "messages" not in r


def test_mixed_contains_every_shape() -> None:
    tenants = {r["tenant"].split("-")[0] for r in _trace("mixed")}
    assert tenants == {"chat", "agent", "rag", "oneoff", "assistant"}


def _conversations(trace: list[TraceRecord]) -> dict[str, list[TraceRecord]]:
    out: dict[str, list[TraceRecord]] = {}
    for r in trace:
        if r["conversation"] is not None:
            out.setdefault(r["conversation"], []).append(r)
    return out


@pytest.mark.parametrize("shape", ["chat", "agentic", "shared_system"])
def test_conversations_grow_by_appending(shape: str) -> None:
    conversations = _conversations(_trace(shape))
    assert any(len(turns) >= 3 for turns in conversations.values())
    for turns in conversations.values():
        for prev, nxt in itertools.pairwise(turns):
            if shape == "agentic":
                assert nxt["prompt"].startswith(prev["prompt"])
                assert len(nxt["prompt"]) > len(prev["prompt"])
            else:
                n = len(prev["messages"])
                assert nxt["messages"][:n] == prev["messages"]
                roles = [m["role"] for m in nxt["messages"][n:]]
                assert roles == ["assistant", "user"]
                assert len(nxt["messages"][n]["content"]) == traces.REPLY_TOKENS * CHARS_PER_TOKEN


@pytest.mark.parametrize("shape", ["chat", "agentic", "shared_system"])
def test_turns_never_overlap(shape: str) -> None:
    bound = ServiceBound()
    for turns in _conversations(_trace(shape)).values():
        for prev, nxt in itertools.pairwise(turns):
            prev_tokens = approx_tokens(traces.prompt_text(prev))
            assert nxt["t_s"] >= prev["t_s"] + bound.seconds(prev_tokens, MAX_TOKENS) - 1e-6


def test_one_shared_system_prompt_is_shared_by_all() -> None:
    systems = {r["messages"][0]["content"] for r in _trace("shared_system")}
    assert len(systems) == 1
    assert approx_tokens(systems.pop()) >= traces.SHARED_SYSTEM_TOKENS


def test_unique_prompts_share_nothing() -> None:
    assert ideal_hits(_trace("unique")).cached_tokens == 0


def test_rag_documents_follow_popularity() -> None:
    trace = generate({"rag": 1.0}, rate_per_s=20.0, duration_s=30.0, seed=3)
    counts: dict[str, int] = {}
    for r in trace:
        doc = r["messages"][1]["content"].split(":", 1)[0]  # "Document <i>"
        counts[doc] = counts.get(doc, 0) + 1
    assert counts.get("Document 0", 0) > counts.get("Document 40", 0)


@pytest.mark.parametrize("n_tokens", [1, 16, 333, 2_000])
def test_words_text_has_the_asked_size(n_tokens: int) -> None:
    text = words_text(random.Random(0), n_tokens)
    assert len(text) == n_tokens * CHARS_PER_TOKEN
    assert approx_tokens(text) == n_tokens
    assert not text.endswith(" ")


def test_unknown_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown"):
        shape_trace("nope", rate_per_s=1.0, duration_s=1.0, seed=0)


# --- ideal hit rate on hand-made traces (block size 4 tokens = 16 characters) ----------------

BLOCK = 4
A = "a" * 64  # 4 full blocks, 16 tokens
B = "b" * 64


def _rec(t_s: float, prompt: str, **extra: Any) -> dict[str, Any]:
    return {"t_s": t_s, "endpoint": "completions", "prompt": prompt, **extra}


IDEAL_CASES = [
    ([_rec(0, A)], 16, 0),
    ([_rec(0, A), _rec(1, B)], 32, 0),
    # the same 16-token prompt again: its last token is always computed, so 3 of 4 blocks hit
    ([_rec(0, A), _rec(1, A)], 32, 12),
    # an extension: all 4 blocks of the earlier prompt hit, the 2 new blocks do not
    ([_rec(0, A), _rec(1, A + B[:32])], 16 + 24, 16),
    # diverging inside block 2: only the first full block is shared
    ([_rec(0, A), _rec(1, A[:20] + B[:44])], 32, 4),
    # a partial trailing block is never cached, even when repeated
    ([_rec(0, A + "xyz"), _rec(1, A + "xyz")], 17 + 17, 16),
    # arrival order, not list order, decides which one is "earlier"
    ([_rec(5, A + B), _rec(1, A)], 16 + 32, 16),
    # different models never share blocks
    ([_rec(0, A, model="m1"), _rec(1, A, model="m2")], 32, 0),
    # three requests build on each other
    ([_rec(0, A), _rec(1, A + B), _rec(2, A + B + A)], 16 + 32 + 48, 16 + 32),
]


@pytest.mark.parametrize(
    ("trace", "prompt_tokens", "cached_tokens"),
    IDEAL_CASES,
    ids=[
        "single",
        "disjoint",
        "repeat-keeps-last-token",
        "extension",
        "diverge-mid-block",
        "partial-block",
        "arrival-order",
        "other-model",
        "growing-chain",
    ],
)
def test_ideal_hits(trace: list[dict[str, Any]], prompt_tokens: int, cached_tokens: int) -> None:
    hits = ideal_hits(trace, BLOCK)
    assert (hits.prompt_tokens, hits.cached_tokens) == (prompt_tokens, cached_tokens)
    assert hits.hit_rate == pytest.approx(cached_tokens / prompt_tokens)


def test_ideal_hit_rate_of_chat_counts_the_rendered_messages() -> None:
    messages = [{"role": "system", "content": A}, {"role": "user", "content": B}]
    trace = [
        {"t_s": 0, "endpoint": "chat", "messages": messages},
        {"t_s": 1, "endpoint": "chat", "messages": messages},
    ]
    assert 0.4 < traces.ideal_hit_rate(trace, BLOCK) < 0.5


def test_cli_writes_the_trace_and_prints_the_ideal(tmp_path: Any, capsys: Any) -> None:
    out = tmp_path / "t.jsonl"
    args = [
        "--shape",
        "mixed",
        "--rate",
        "5",
        "--duration-s",
        "5",
        "--seed",
        "1",
        "--out",
        str(out),
    ]
    assert traces.main(args) == 0
    trace = traces.read_trace(out)
    assert trace == shape_trace("mixed", rate_per_s=5, duration_s=5, seed=1)
    assert f"{ideal_hits(trace).hit_rate:.1%}" in capsys.readouterr().out
