"""Seeded traces for the tier benchmarks (loadtest/bench/tiers.py and the demo's second section).

  voice           a latency-critical tenant: one fixed system prompt, a short utterance, a short
                  answer; single turns at a modest Poisson rate.
  standard_burst  standard traffic with long prefixes: a share of one-off long prompts (nothing to
                  reuse) and questions about a set of long shared documents; a base rate plus a
                  burst in the middle of the run that saturates the fleet.
  reuse           the remote-tier admission workloads, by REUSE_SHAPES: `low` (mostly one-off long
                  prompts), `high` (questions about long shared documents, Zipf popularity),
                  `low_shared_header` (one-off documents behind one short shared instruction).

Records are loadtest.workloads.traces.TraceRecord, so loadtest.bench.replay replays them. Sizes are
in tokens at routing.prompt.CHARS_PER_TOKEN characters per token, as in
loadtest/workloads/traces.py.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from loadtest.workloads.traces import (
    DOCUMENT_HEAD,
    TraceRecord,
    between,
    numbered_texts,
    unique_text,
    words_text,
    zipf_weights,
)

VOICE_SYSTEM_TOKENS = 600
# A voice agent's instructions (persona, tone, tools): a few hundred tokens, far shorter than the
# standard tenants' documents, and the same in every request.
VOICE_USER_TOKENS = (15, 50)  # one spoken sentence, transcribed
VOICE_MAX_TOKENS = 12  # the first words of a spoken answer: TTFT is what the user hears

STANDARD_DOC_TOKENS = (4_000, 7_000)  # long shared documents / system prompts
STANDARD_DOCS = 16
STANDARD_QUESTION_TOKENS = (100, 400)
STANDARD_UNIQUE_TOKENS = (4_000, 8_000)  # one-off long prompts: nothing to reuse
STANDARD_UNIQUE_SHARE = 0.5
STANDARD_MAX_TOKENS = 16

BURST_WINDOW = (0.25, 0.75)  # the burst runs over this fraction of the trace's duration

REUSE_DOC_TOKENS = (3_000, 6_000)
REUSE_QUESTION_TOKENS = (20, 80)
REUSE_UNIQUE_TOKENS = (2_000, 6_000)
REUSE_MAX_TOKENS = 16
HIGH_REUSE_DOCS = 24
HIGH_REUSE_ZIPF_S = 0.8
# Popularity ~ 1 / rank^0.8 over 24 documents: the top few are asked about many times, the tail a
# few times, so a reuse-aware policy has both families worth writing and families not worth it.
LOW_REUSE_REPEAT_SHARE = 0.1  # `low`: a tenth of the prompts are about one of LOW_REUSE_DOCS
LOW_REUSE_DOCS = 4
SHARED_HEADER_TOKENS = 200  # `low_shared_header`: the instruction every one-off document follows

MAX_RECORDS = 100_000  # bounds every generator whatever its rate and duration


@dataclass(frozen=True, slots=True)
class Rate:
    """Poisson arrivals at `base_per_s`, plus `burst_per_s` more inside `window` (fractions)."""

    base_per_s: float
    burst_per_s: float = 0.0
    window: tuple[float, float] = BURST_WINDOW

    def at(self, t_s: float, duration_s: float) -> float:
        lo, hi = self.window
        inside = lo * duration_s <= t_s < hi * duration_s
        return self.base_per_s + (self.burst_per_s if inside else 0.0)

    @property
    def peak_per_s(self) -> float:
        return self.base_per_s + self.burst_per_s


# Offered load of the benchmarks (loadtest/bench/tiers.py) and the demo's second section.

VOICE_RATE_PER_S = 3.0  # one voice agent's users: a request every ~300 ms

STANDARD_RATE = Rate(base_per_s=3.0, burst_per_s=6.0)
# 3 req/s of ~6k-token prompts, half of them one-off (~460 ms of 70B prefill each), is ~40% of
# 4 replicas; the burst (9 req/s over the middle half) asks for more prefill than 4 replicas do.

REUSE_RATE_PER_S = 8.0
# ~8 x 4.5k tokens/s of 8B prompts against 4 x 30k tokens/s of prefill: busy but not saturated,
# so TTFT shows where the KV came from rather than queueing.


def arrivals(rate: Rate, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival offsets of a Poisson process with a piecewise-constant rate (by thinning)."""
    peak = rate.peak_per_s
    if peak <= 0 or duration_s <= 0:
        return []
    out: list[float] = []
    t_s = 0.0
    limit = min(MAX_RECORDS, math.ceil(peak * duration_s * 4) + 100)
    for _ in range(limit):
        t_s += rng.expovariate(peak)
        if t_s >= duration_s:
            break
        if rng.random() < rate.at(t_s, duration_s) / peak:
            out.append(round(t_s, 6))
    return out


def _chat(t_s: float, tenant: str, system: str, user: str, max_tokens: int) -> TraceRecord:
    messages = [{"role": "user", "content": user}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return {
        "t_s": t_s,
        "tenant": tenant,
        "endpoint": "chat",
        "max_tokens": max_tokens,
        "conversation": None,
        "messages": messages,
    }


def voice(rate_per_s: float, duration_s: float, seed: int) -> list[TraceRecord]:
    rng = random.Random(f"voice-{seed}")
    system = "You are the voice agent of a train operator. " + words_text(rng, VOICE_SYSTEM_TOKENS)
    return [
        _chat(
            t, "voice", system, words_text(rng, between(rng, VOICE_USER_TOKENS)), VOICE_MAX_TOKENS
        )
        for t in arrivals(Rate(rate_per_s), duration_s, rng)
    ]


def standard_burst(rate: Rate, duration_s: float, seed: int) -> list[TraceRecord]:
    rng = random.Random(f"standard-{seed}")
    docs_rng = random.Random(f"standard-docs-{seed}")
    docs = numbered_texts(docs_rng, STANDARD_DOCS, DOCUMENT_HEAD, STANDARD_DOC_TOKENS)
    trace: list[TraceRecord] = []
    for t in arrivals(rate, duration_s, rng):
        if rng.random() < STANDARD_UNIQUE_SHARE:
            text = unique_text(rng, STANDARD_UNIQUE_TOKENS)
            trace.append(_chat(t, "web", "", text, STANDARD_MAX_TOKENS))
            continue
        question = words_text(rng, between(rng, STANDARD_QUESTION_TOKENS))
        trace.append(_chat(t, "web", rng.choice(docs), question, STANDARD_MAX_TOKENS))
    return trace


@dataclass(frozen=True, slots=True)
class _Corpus:
    docs: list[str]
    weights: list[float]  # Zipf popularity of docs
    header: str  # the shared instruction of `low_shared_header`

    @classmethod
    def build(cls, seed: int) -> _Corpus:
        rng = random.Random(f"reuse-docs-{seed}")
        docs = numbered_texts(rng, HIGH_REUSE_DOCS, DOCUMENT_HEAD, REUSE_DOC_TOKENS)
        weights = zipf_weights(HIGH_REUSE_DOCS, HIGH_REUSE_ZIPF_S)
        header = "Summarise the document below for a support agent. " + words_text(
            rng, SHARED_HEADER_TOKENS
        )
        return cls(docs, weights, header)


def _low(rng: random.Random, corpus: _Corpus) -> tuple[str, str]:
    if rng.random() < LOW_REUSE_REPEAT_SHARE:
        return corpus.docs[rng.randrange(LOW_REUSE_DOCS)], _question(rng)
    return "", unique_text(rng, REUSE_UNIQUE_TOKENS)


def _high(rng: random.Random, corpus: _Corpus) -> tuple[str, str]:
    return rng.choices(corpus.docs, weights=corpus.weights)[0], _question(rng)


def _low_shared_header(rng: random.Random, corpus: _Corpus) -> tuple[str, str]:
    return corpus.header, words_text(rng, between(rng, REUSE_UNIQUE_TOKENS))


def _question(rng: random.Random) -> str:
    return "Question: " + words_text(rng, between(rng, REUSE_QUESTION_TOKENS))


REUSE_SHAPES: dict[str, Callable[[random.Random, _Corpus], tuple[str, str]]] = {
    "low": _low,
    "high": _high,
    "low_shared_header": _low_shared_header,
}


def reuse(shape: str, rate_per_s: float, duration_s: float, seed: int) -> list[TraceRecord]:
    """One of REUSE_SHAPES as (system, user) chat requests of tenant `web`."""
    if shape not in REUSE_SHAPES:
        raise ValueError(f"unknown reuse shape {shape!r}; known: {sorted(REUSE_SHAPES)}")
    make = REUSE_SHAPES[shape]
    rng = random.Random(f"reuse-{shape}-{seed}")
    corpus = _Corpus.build(seed)
    trace: list[TraceRecord] = []
    for t in arrivals(Rate(rate_per_s), duration_s, rng):
        system, user = make(rng, corpus)
        trace.append(_chat(t, "web", system, user, REUSE_MAX_TOKENS))
    return trace
