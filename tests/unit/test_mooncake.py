"""loadtest/workloads/mooncake.py: Mooncake's trace records as requests that share exactly the
prefix blocks the trace says they share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.workloads import mooncake, traces
from routing.prompt import CHARS_PER_TOKEN, approx_tokens

RECORDS: list[mooncake.MooncakeRecord] = [
    {"timestamp": 1000, "input_length": 1300, "output_length": 80, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 1100, "output_length": 1000, "hash_ids": [0, 1, 3]},
    {"timestamp": 3000, "input_length": 600, "output_length": 3, "hash_ids": [4, 5]},
]


def write(path: Path, records: list[mooncake.MooncakeRecord]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("t.jsonl", mooncake.Spec(Path("t.jsonl"))),
        ("a/t.jsonl@10:20", mooncake.Spec(Path("a/t.jsonl"), 10, 20)),
        ("t.jsonl@5:", mooncake.Spec(Path("t.jsonl"), 5, None)),
    ],
    ids=["whole", "window", "from"],
)
def test_spec_parses_a_file_and_a_window(text: str, spec: mooncake.Spec) -> None:
    assert mooncake.Spec.parse(text) == spec


def test_a_bad_window_says_the_form() -> None:
    with pytest.raises(ValueError, match="PATH@START:COUNT"):
        mooncake.Spec.parse("t.jsonl@x:1")


def test_shared_block_ids_become_shared_text_and_nothing_else_is_shared() -> None:
    a, b, c = mooncake.to_trace(RECORDS)
    block = mooncake.BLOCK_TOKENS * CHARS_PER_TOKEN
    assert a["prompt"][: 2 * block] == b["prompt"][: 2 * block]  # ids 0 and 1
    assert a["prompt"][2 * block : 3 * block] != b["prompt"][2 * block : 3 * block]
    assert c["prompt"][:block] != a["prompt"][:block]
    # the ideal hit rate is the trace's: b reuses its 2 full blocks (128 tokens) of 3
    ideal = traces.ideal_hits([a, b, c])
    assert ideal.cached_tokens == 2 * mooncake.BLOCK_TOKENS


def test_lengths_scale_by_the_block_ratio_and_the_last_block_in_proportion() -> None:
    a, _, c = mooncake.to_trace(RECORDS)
    # 1300 tokens = 2 full blocks of 512 + 276: 64 + 64 + ceil(276 / 8) = 163
    assert approx_tokens(a["prompt"]) == 2 * 64 + 35
    assert approx_tokens(c["prompt"]) == 64 + 11  # 600 = 512 + 88 -> 64 + 11
    assert a["endpoint"] == "completions" and a["conversation"] is None


def test_output_scales_with_a_floor_of_one_and_a_cap() -> None:
    a, b, c = mooncake.to_trace(RECORDS, max_output_tokens=50)
    assert (a["max_tokens"], b["max_tokens"], c["max_tokens"]) == (10, 50, 1)


def test_time_starts_at_zero_and_scales() -> None:
    trace = mooncake.to_trace(RECORDS, time_scale=0.5)
    assert [r["t_s"] for r in trace] == [0.0, 0.25, 1.0]


def test_load_reads_a_window_or_a_project_trace(tmp_path: Path) -> None:
    path = write(tmp_path / "conversation_trace.jsonl", RECORDS)
    window = mooncake.load(f"mooncake:{path}@1:1")
    assert len(window) == 1 and window[0]["t_s"] == 0.0
    assert window[0]["prompt"] == mooncake.to_trace(RECORDS)[1]["prompt"]
    own = tmp_path / "own.jsonl"
    traces.write_trace(window, own)
    assert mooncake.load(str(own)) == window
