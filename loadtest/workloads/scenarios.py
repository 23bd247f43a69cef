"""Traces the routing benchmark adds to loadtest/workloads/traces.py's shapes: the voice tenant, the
critical-tenant burst and the tiered mixes. No Locust here (importing it monkey-patches)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.workloads import traces
from loadtest.workloads.traces import Request, Session, TraceRecord

VOICE_TENANT = "voice"
VOICE_SYSTEM_TOKENS = 300  # a voice agent's persona and rules: short, latency matters
VOICE_USER_TOKENS = (8, 40)  # one spoken sentence
VOICE_REPLY_TOKENS = 30  # the previous spoken answer, appended to the conversation
VOICE_TURNS = (3, 10)
VOICE_THINK_MEAN_S = 1.5  # the caller listens to the answer, then speaks again

LOW_REUSE_MIX = {"unique": 0.6, "rag": 0.2, "chat": 0.2}
# Mostly one-off prompts: writing their KV to a remote tier is wasted network.
HIGH_REUSE_MIX = {"agentic": 0.35, "chat": 0.35, "rag": 0.3}
# Sessions and shared documents: most prompt tokens were seen before, somewhere.


def voice_system_prompt(seed: int) -> str:
    return "You are a voice assistant. " + traces.words_text(
        random.Random(f"{seed}-voice"), VOICE_SYSTEM_TOKENS
    )


def voice_session(rng: random.Random, seed: int) -> Session:
    """One call: a shared short system prompt, then short spoken turns and answers."""
    messages = [{"role": "system", "content": voice_system_prompt(seed)}]
    for turn in range(rng.randint(*VOICE_TURNS)):
        if turn:
            reply = traces.words_text(rng, VOICE_REPLY_TOKENS)
            messages.append({"role": "assistant", "content": reply})
        user = traces.words_text(rng, rng.randint(*VOICE_USER_TOKENS))
        messages.append({"role": "user", "content": user})
        request: Request = {"endpoint": "chat", "tenant": VOICE_TENANT, "messages": list(messages)}
        yield request


@dataclass
class _Call:
    name: str
    turns: Session
    ready_at_s: float


def voice_trace(*, rate_per_s: float, duration_s: float, seed: int) -> list[TraceRecord]:
    """Poisson arrivals; each continues the call that has been ready longest, or starts one."""
    rng = random.Random(f"{seed}-voice-arrivals")
    calls: list[_Call] = []
    trace: list[TraceRecord] = []
    t_s, started = 0.0, 0
    max_records = int(rate_per_s * duration_s * 4) + 100  # Poisson never gets near this
    while len(trace) < max_records:
        t_s += rng.expovariate(rate_per_s)
        if t_s >= duration_s:
            break
        ready = [c for c in calls if c.ready_at_s <= t_s]
        call = min(ready, key=lambda c: c.ready_at_s) if ready else None
        request = next(call.turns, None) if call else None
        if call is not None and request is None:
            calls.remove(call)
        if call is None or request is None:
            started += 1
            call = _Call(
                f"voice-{started}",
                voice_session(random.Random(f"{seed}-call-{started}"), seed),
                t_s,
            )
            calls.append(call)
            request = next(call.turns)
        trace.append(
            {
                "t_s": round(t_s, 6),
                "tenant": VOICE_TENANT,
                "endpoint": "chat",
                "max_tokens": traces.MAX_TOKENS,
                "conversation": call.name,
                "messages": request["messages"],
            }
        )
        call.ready_at_s = t_s + rng.expovariate(1.0 / VOICE_THINK_MEAN_S) + 0.5
    return trace


def critical_trace(
    *,
    voice_rate_per_s: float,
    burst_rate_per_s: float,
    duration_s: float,
    seed: int,
    bound: traces.ServiceBound,
) -> list[TraceRecord]:
    """Voice all along; a `mixed` burst of standard traffic in the middle half."""
    voice = voice_trace(rate_per_s=voice_rate_per_s, duration_s=duration_s, seed=seed)
    burst = traces.mixed(
        rate_per_s=burst_rate_per_s, duration_s=duration_s / 2, seed=seed, bound=bound
    )
    for record in burst:
        record["t_s"] = round(record["t_s"] + duration_s / 4, 6)
    return sorted(voice + burst, key=lambda r: r["t_s"])
