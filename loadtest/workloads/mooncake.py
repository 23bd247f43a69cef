"""Mooncake's public production traces as replayable requests.

kvcache-ai/Mooncake, FAST'25 release (`FAST25-release/traces/{conversation,toolagent,synthetic}
_trace.jsonl`, `FAST25-release/arxiv-trace/mooncake_trace.jsonl`; its README describes the
format): one JSON line per request,

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

`timestamp` in ms from the trace's start, lengths in tokens, and one id per 512-token block of the
prompt: equal ids are equal prefix content (ids are chained: a block id stands for the whole prefix
up to it). Raw text is not released, so a record becomes a /v1/completions request whose prompt is
each of its block ids' own fixed text, one after another: every router's own prefix hashing sees
exactly the sharing the trace has, and the ideal hit rate (one unlimited cache) is the trace's.

Scaling, so two cores can drive a slice: a 512-token block becomes `block_tokens` tokens (64 by
default: prompts of 5-30k tokens become 0.6-4k), the last, partial block in proportion; output
lengths by the same factor (at least 1, at most `max_output_tokens`); arrival times by
`time_scale` (a benchmark sets it to offer the load it wants).

A trace spec, as `--trace` takes it: `mooncake:PATH` (the whole file) or
`mooncake:PATH@START:COUNT` (COUNT records from record START); any other value is a JSONL trace
of this project's own format (loadtest/workloads/traces.py).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from loadtest.workloads.traces import TraceRecord, read_trace, words_text
from routing.prompt import CHARS_PER_TOKEN

MOONCAKE_BLOCK_TOKENS = 512  # the release's README: "The block size is 512 tokens"
BLOCK_TOKENS = 64
# Simulated tokens per 512-token block: 1/8 scale, so the traces' 5-30k-token prompts (mean 12k in
# the conversation trace, 15k in the synthetic one, per the release's README) become 0.6-4k, what
# simulated replicas on two shared cores prefill in tens to hundreds of ms.
MAX_OUTPUT_TOKENS = 64
# Decode tokens cost the simulator's Python a step each; the traces' mean outputs (149-343 tokens)
# at 1/8 scale are 19-43, and a few long answers are capped here.
TENANT = "mooncake"
PREFIX = "mooncake:"


class MooncakeRecord(TypedDict):
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(frozen=True, slots=True)
class Spec:
    """Where a Mooncake slice comes from: a file, and which records of it."""

    path: Path
    start: int = 0
    count: int | None = None  # None: to the end

    @classmethod
    def parse(cls, text: str) -> Spec:
        """`PATH` or `PATH@START:COUNT` (the part after `mooncake:`)."""
        path, _, window = text.rpartition("@") if "@" in text else (text, "", "")
        if not window:
            return cls(Path(path))
        start, _, count = window.partition(":")
        try:
            return cls(Path(path), int(start), int(count) if count else None)
        except ValueError:
            raise ValueError(f"mooncake:{text}: expected PATH or PATH@START:COUNT") from None


def read_records(spec: Spec) -> list[MooncakeRecord]:
    """The slice's records, in file order (which is timestamp order in the release)."""
    out: list[MooncakeRecord] = []
    stop = None if spec.count is None else spec.start + spec.count
    with spec.path.open() as f:
        for i, line in enumerate(f):
            if stop is not None and i >= stop:
                break
            if i >= spec.start and line.strip():
                out.append(json.loads(line))
    return out


def block_text(block_id: int, tokens: int) -> str:
    """The fixed text of one block id: the same id gives the same text in every record."""
    return words_text(random.Random(f"mooncake-block-{block_id}"), tokens)


def to_trace(
    records: Sequence[MooncakeRecord],
    *,
    block_tokens: int = BLOCK_TOKENS,
    time_scale: float = 1.0,
    max_output_tokens: int = MAX_OUTPUT_TOKENS,
) -> list[TraceRecord]:
    """Records as completions requests at (timestamp - first) / 1000 * time_scale seconds."""
    if not records:
        return []
    scale = block_tokens / MOONCAKE_BLOCK_TOKENS
    t0 = records[0]["timestamp"]
    trace: list[TraceRecord] = []
    for r in records:
        ids = r["hash_ids"]
        last_tokens = r["input_length"] - MOONCAKE_BLOCK_TOKENS * (len(ids) - 1)
        parts = [block_text(i, block_tokens) for i in ids[:-1]]
        tail = max(1, min(block_tokens, math.ceil(max(1, last_tokens) * scale)))
        parts.append(block_text(ids[-1], block_tokens)[: tail * CHARS_PER_TOKEN])
        output = max(1, min(max_output_tokens, round(r["output_length"] * scale)))
        trace.append(
            TraceRecord(
                t_s=(r["timestamp"] - t0) / 1000 * time_scale,
                tenant=TENANT,
                endpoint="completions",
                max_tokens=output,
                conversation=None,
                prompt="".join(parts),
            )
        )
    return trace


def load(
    spec: str,
    *,
    block_tokens: int = BLOCK_TOKENS,
    time_scale: float = 1.0,
    max_output_tokens: int = MAX_OUTPUT_TOKENS,
) -> list[TraceRecord]:
    """A `--trace` value: `mooncake:PATH[@START:COUNT]` (scaled as to_trace), or a JSONL trace of
    this project's format (as it is)."""
    if not spec.startswith(PREFIX):
        return read_trace(Path(spec))
    records = read_records(Spec.parse(spec.removeprefix(PREFIX)))
    return to_trace(
        records,
        block_tokens=block_tokens,
        time_scale=time_scale,
        max_output_tokens=max_output_tokens,
    )


def span_s(records: Iterable[MooncakeRecord]) -> float:
    """Seconds from the first record's arrival to the last's, unscaled."""
    stamps = [r["timestamp"] for r in records]
    return (max(stamps) - min(stamps)) / 1000 if stamps else 0.0
