"""Seeded request traces for replay: one generator per workload shape, plus `mixed`.

A trace is a list of records (JSONL on disk), sorted by arrival offset:
    {"t_s": 1.234, "tenant": "chat-app-2", "endpoint": "chat", "messages": [...],
     "max_tokens": 32, "conversation": "chat-17"}          # or "prompt": "..." for completions

Shapes (what makes KV cache reuse possible, and for whom):
  chat           several apps, each with its own long system prompt; conversations grow turn by
                 turn (the previous assistant reply, a fixed-length placeholder since the trace is
                 generated offline, then a new user message).
  agentic        a long tool-definition prompt plus a scratchpad that grows every step
                 (thought, action, observation), sent to /v1/completions.
  rag            one of N shared documents, picked with Zipf popularity, plus a unique question.
  unique         single-turn prompts that share nothing: no router can reuse anything.
  shared_system  every conversation shares ONE long system prompt: the case where a router that
                 only follows the longest prefix match piles every request onto one replica.
  mixed          all of the above; each arrival picks a shape by MIXED_WEIGHTS.

Arrivals are Poisson at `rate_per_s`. Each arrival first picks a shape; a multi-turn shape then
continues the session that has been ready the longest (its previous turn is over, by a
conservative service-time bound plus a think time), or starts a new one when none is ready. So
turns of one session never overlap, and the request mix follows the weights.

Sizes are in tokens at routing.prompt.CHARS_PER_TOKEN characters per token; text is drawn from a
fixed word list with a seeded rng, so a (shape, rate, duration, seed) always gives the same trace.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS, block_hashes
from routing.prompt import CHARS_PER_TOKEN, approx_tokens, chat_text, completion_text

DEFAULT_MODEL = "sim-llama-8b"  # the simulated replica's model name (loadtest/sim/config.py)

Endpoint = Literal["chat", "completions"]


class TraceRecord(TypedDict):
    t_s: float  # arrival offset from the start of the replay
    tenant: str
    endpoint: Endpoint
    max_tokens: int
    conversation: str | None  # session id; None for single-turn requests
    messages: NotRequired[list[dict[str, str]]]
    prompt: NotRequired[str]


# --- sizes (tokens) -------------------------------------------------------------------------
# Chosen to look like production traffic at a small scale, not measured from one: system prompts
# of a few thousand tokens are common for assistants and agents (published system prompts of
# coding agents run 2-10k tokens); RAG chunks of 1-3k tokens are typical retrieval payloads.

MAX_TOKENS = 24
# Output length per request. Short on purpose: the demo is about prefill (TTFT); long decodes would
# only add streaming chunks that cost CPU on a 2-core machine without changing the comparison.

REPLY_TOKENS = 300
# The placeholder assistant reply that the next turn appends (a typical chat reply is 100-300
# tokens); fixed length because the trace is generated offline, before any model answers.

CHAT_APPS = 8  # distinct chat applications, each with its own system prompt
CHAT_SYSTEM_TOKENS = (800, 1_500)  # per-app system prompt, uniform in this range
CHAT_USER_TOKENS = (100, 400)  # each user message
CHAT_TURNS = (4, 16)  # turns per conversation, uniform

AGENT_APPS = 4  # distinct agents, each with its own tool-definition prompt
AGENT_TOOLS_TOKENS = (1_500, 2_500)
AGENT_TASK_TOKENS = (40, 160)
AGENT_THOUGHT_TOKENS = 80  # placeholder model output per step (thought + action), fixed
AGENT_OBSERVATION_TOKENS = (500, 1_500)  # tool output appended per step
AGENT_STEPS = (4, 16)

CHAT_SYSTEM_HEAD = "You are the assistant of app {i}. "
AGENT_TOOLS_HEAD = "Agent {i}. Tools available:\n"
DOCUMENT_HEAD = "Document {i}:\n"
RAG_DOCUMENTS = 80
RAG_DOCUMENT_TOKENS = (1_000, 3_000)
RAG_ZIPF_S = 1.1  # document popularity ~ 1 / rank^s; s ~ 1 is the classic web/document skew
RAG_QUESTION_TOKENS = (15, 60)

UNIQUE_TOKENS = (300, 1_500)

SHARED_SYSTEM_TOKENS = 1_500
SHARED_USER_TOKENS = (100, 400)
SHARED_TURNS = (4, 16)

MIXED_WEIGHTS: dict[str, float] = {
    "chat": 0.30,
    "agentic": 0.30,
    "rag": 0.15,
    "unique": 0.10,
    "shared_system": 0.15,
}
# Share of requests per shape in `mixed`: mostly session traffic (chat and agents dominate LLM API
# traffic), a fifth retrieval, and some one-off prompts that no cache helps.

THINK_MEAN_S = 1.0
# Mean user/tool think time between the end of one turn and the next (exponential). Real users
# take longer; a short value keeps several turns of each session inside a 25 s demo.


@dataclass(frozen=True, slots=True)
class ServiceBound:
    """A conservative bound on how long a request takes, so the next turn starts after it.

    The defaults are the simulated replica at time factor 4 running at half speed (queueing):
    30k prefill tokens/s (routing.cost.PREFILL_TOKENS_PER_S) / 4 / 2, and 10 ms per output token
    (loadtest.sim.config.ITL_S) * 4 * 2.
    """

    prefill_tokens_per_s: float = 3_750.0
    itl_s: float = 0.08

    def seconds(self, prompt_tokens: int, max_tokens: int) -> float:
        return prompt_tokens / self.prefill_tokens_per_s + max_tokens * self.itl_s


# --- text ------------------------------------------------------------------------------------

_WORD_LIST = (
    "the of and to in is that for it as with was on be by this are from at or an have not which "
    "but all were when we there can more if will one about up out has would their what so into "
    "time system data model request cache memory server user value service network process "
    "result first state table query order report policy change record number market energy "
    "customer account payment invoice product price stock supply design review project team "
    "client contract release version feature issue error test build deploy config cluster node "
    "region latency budget metric signal sensor device battery engine vehicle route travel "
    "weather season river mountain forest garden kitchen recipe flavor music movie story chapter "
    "history science physics biology chemistry language history law court patient doctor "
    "treatment health insurance school student lesson teacher course exam library museum city "
    "street building bridge station airport flight hotel ticket schedule meeting email message "
    "document section paragraph summary question answer reason example detail option choice "
    "should could must might often usually quickly carefully clearly simply new old large small "
    "high low early late important possible available different similar general specific "
    "public private local global open close start stop check update create delete read write "
    "send receive return compute measure compare explain describe improve reduce increase"
)
WORDS = tuple(_WORD_LIST.split())


def words_text(rng: random.Random, n_tokens: int) -> str:
    """Sentence-like text of exactly n_tokens * CHARS_PER_TOKEN characters."""
    n_chars = max(1, n_tokens * CHARS_PER_TOKEN)
    sentences: list[str] = []
    size = 0
    while size <= n_chars:  # +1 per sentence for the joining space, which the last one lacks
        words = rng.choices(WORDS, k=rng.randint(6, 16))
        words[0] = words[0].capitalize()
        sentence = " ".join(words) + "."
        sentences.append(sentence)
        size += len(sentence) + 1
    text = " ".join(sentences)[:n_chars]
    return text[:-1] + "." if text.endswith(" ") else text


def between(rng: random.Random, bounds: tuple[int, int]) -> int:
    """A length drawn uniformly from `bounds` (both ends included)."""
    return rng.randint(bounds[0], bounds[1])


def numbered_texts(rng: random.Random, count: int, head: str, bounds: tuple[int, int]) -> list[str]:
    """`count` texts (system prompts, tools, documents): the i-th is `head` with {i} filled in,
    then a length drawn from `bounds` of words."""
    return [head.format(i=i) + words_text(rng, between(rng, bounds)) for i in range(count)]


def unique_text(rng: random.Random, bounds: tuple[int, int]) -> str:
    """A prompt unique from its first block on (its first words are a random id)."""
    return f"Request {rng.getrandbits(64):016x}. " + words_text(rng, between(rng, bounds))


def zipf_weights(count: int, s: float) -> list[float]:
    """Popularity of ranks 1..count ~ 1 / rank^s."""
    return [1.0 / (rank + 1) ** s for rank in range(count)]


# --- sessions --------------------------------------------------------------------------------

Request = dict[str, Any]  # endpoint, tenant, max_tokens, messages or prompt
Session = Iterator[Request]  # yields one request per turn


@dataclass
class _Shared:
    """Prefixes shared across sessions of a trace (system prompts, tools, documents)."""

    chat_systems: list[str]
    agent_tools: list[str]
    documents: list[str]
    doc_weights: list[float]
    shared_system: str

    @classmethod
    def build(cls, rng: random.Random) -> _Shared:
        chat = numbered_texts(rng, CHAT_APPS, CHAT_SYSTEM_HEAD, CHAT_SYSTEM_TOKENS)
        tools = numbered_texts(rng, AGENT_APPS, AGENT_TOOLS_HEAD, AGENT_TOOLS_TOKENS)
        docs = numbered_texts(rng, RAG_DOCUMENTS, DOCUMENT_HEAD, RAG_DOCUMENT_TOKENS)
        weights = zipf_weights(RAG_DOCUMENTS, RAG_ZIPF_S)
        shared = "You are a helpful assistant. " + words_text(rng, SHARED_SYSTEM_TOKENS)
        return cls(chat, tools, docs, weights, shared)


def _chat_session(
    rng: random.Random, tenant: str, system: str, user_tokens: tuple[int, int], turns: int
) -> Session:
    messages = [{"role": "system", "content": system}]
    for turn in range(turns):
        if turn:
            messages.append({"role": "assistant", "content": words_text(rng, REPLY_TOKENS)})
        messages.append({"role": "user", "content": words_text(rng, between(rng, user_tokens))})
        yield {"endpoint": "chat", "tenant": tenant, "messages": list(messages)}


def chat_session(rng: random.Random, shared: _Shared) -> Session:
    app = rng.randrange(len(shared.chat_systems))
    turns = between(rng, CHAT_TURNS)
    return _chat_session(rng, f"chat-app-{app}", shared.chat_systems[app], CHAT_USER_TOKENS, turns)


def shared_system_session(rng: random.Random, shared: _Shared) -> Session:
    turns = between(rng, SHARED_TURNS)
    return _chat_session(rng, "assistant", shared.shared_system, SHARED_USER_TOKENS, turns)


def agentic_session(rng: random.Random, shared: _Shared) -> Session:
    agent = rng.randrange(len(shared.agent_tools))
    prompt = (
        shared.agent_tools[agent] + "\nTask: " + words_text(rng, between(rng, AGENT_TASK_TOKENS))
    )
    for _ in range(between(rng, AGENT_STEPS)):
        prompt += "\nThought:"
        yield {"endpoint": "completions", "tenant": f"agent-{agent}", "prompt": prompt}
        prompt += " " + words_text(rng, AGENT_THOUGHT_TOKENS)
        prompt += "\nObservation: " + words_text(rng, between(rng, AGENT_OBSERVATION_TOKENS))


def rag_session(rng: random.Random, shared: _Shared) -> Session:
    doc = rng.choices(shared.documents, weights=shared.doc_weights)[0]
    question = words_text(rng, between(rng, RAG_QUESTION_TOKENS))
    content = f"{doc}\n\nQuestion: {question}"
    yield {
        "endpoint": "chat",
        "tenant": "rag",
        "messages": [
            {"role": "system", "content": "Answer from the document below."},
            {"role": "user", "content": content},
        ],
    }


def unique_session(rng: random.Random, shared: _Shared) -> Session:
    text = unique_text(rng, UNIQUE_TOKENS)
    yield {"endpoint": "chat", "tenant": "oneoff", "messages": [{"role": "user", "content": text}]}


SessionFactory = Callable[[random.Random, _Shared], Session]

SHAPES: dict[str, SessionFactory] = {
    "chat": chat_session,
    "agentic": agentic_session,
    "rag": rag_session,
    "unique": unique_session,
    "shared_system": shared_system_session,
}
MULTI_TURN = frozenset({"chat", "agentic", "shared_system"})


# --- arrivals --------------------------------------------------------------------------------


@dataclass
class _Active:
    conversation: str
    turns: Session
    ready_at_s: float


def generate(
    weights: dict[str, float],
    *,
    rate_per_s: float,
    duration_s: float,
    seed: int,
    max_tokens: int = MAX_TOKENS,
    think_mean_s: float = THINK_MEAN_S,
    bound: ServiceBound | None = None,
) -> list[TraceRecord]:
    """A trace of Poisson arrivals over `duration_s`, shapes drawn by `weights`."""
    unknown = set(weights) - set(SHAPES)
    if unknown:
        raise ValueError(f"unknown shapes {sorted(unknown)}; known: {sorted(SHAPES)}")
    if rate_per_s <= 0 or duration_s <= 0:
        raise ValueError("rate_per_s and duration_s must be > 0")
    bound = bound or ServiceBound()
    rng = random.Random(seed)
    shared = _Shared.build(random.Random(f"{seed}-shared"))
    shapes, shape_weights = list(weights), list(weights.values())
    active: dict[str, list[_Active]] = {s: [] for s in shapes}
    started = 0
    trace: list[TraceRecord] = []
    t_s = 0.0
    max_records = math.ceil(rate_per_s * duration_s * 4) + 100  # Poisson never gets near this
    while len(trace) < max_records:
        t_s += rng.expovariate(rate_per_s)
        if t_s >= duration_s:
            break
        shape = rng.choices(shapes, weights=shape_weights)[0]
        ready = [a for a in active[shape] if a.ready_at_s <= t_s]
        request: Request | None = None
        session: _Active | None = None
        if ready:
            session = min(ready, key=lambda a: a.ready_at_s)
            request = next(session.turns, None)
            if request is None:
                active[shape].remove(session)
        if request is None or session is None:
            started += 1
            turns = SHAPES[shape](random.Random(f"{seed}-session-{started}"), shared)
            session = _Active(f"{shape}-{started}", turns, t_s)
            request = next(turns)
            if shape in MULTI_TURN:
                active[shape].append(session)
        record = _record(
            request, t_s, max_tokens, session.conversation if shape in MULTI_TURN else None
        )
        session.ready_at_s = (
            t_s
            + bound.seconds(approx_tokens(prompt_text(record)), max_tokens)
            + rng.expovariate(1.0 / think_mean_s)
        )
        trace.append(record)
    return trace


def _record(request: Request, t_s: float, max_tokens: int, conversation: str | None) -> TraceRecord:
    record: TraceRecord = {
        "t_s": round(t_s, 6),
        "tenant": request["tenant"],
        "endpoint": request["endpoint"],
        "max_tokens": max_tokens,
        "conversation": conversation,
    }
    if request["endpoint"] == "chat":
        record["messages"] = request["messages"]
    else:
        record["prompt"] = request["prompt"]
    return record


def shape_trace(shape: str, **kwargs: Any) -> list[TraceRecord]:
    """The trace of one shape (or `mixed`); kwargs as for generate()."""
    if shape == "mixed":
        return generate(MIXED_WEIGHTS, **kwargs)
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {[*SHAPES, 'mixed']}")
    return generate({shape: 1.0}, **kwargs)


def multi_turn_chat(**kwargs: Any) -> list[TraceRecord]:
    return generate({"chat": 1.0}, **kwargs)


def agentic_loop(**kwargs: Any) -> list[TraceRecord]:
    return generate({"agentic": 1.0}, **kwargs)


def rag_shared_documents(**kwargs: Any) -> list[TraceRecord]:
    return generate({"rag": 1.0}, **kwargs)


def unique_prompts(**kwargs: Any) -> list[TraceRecord]:
    return generate({"unique": 1.0}, **kwargs)


def one_shared_system_prompt(**kwargs: Any) -> list[TraceRecord]:
    return generate({"shared_system": 1.0}, **kwargs)


def mixed(**kwargs: Any) -> list[TraceRecord]:
    return generate(MIXED_WEIGHTS, **kwargs)


# --- the bound no router can beat ------------------------------------------------------------


def prompt_text(record: TraceRecord | dict[str, Any]) -> str:
    """The canonical text a record's prompt hashes over (routing.prompt)."""
    if record["endpoint"] == "chat":
        return chat_text(record["messages"])
    return completion_text(record["prompt"])


@dataclass(frozen=True, slots=True)
class IdealHits:
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def ideal_hits(
    trace: Iterable[TraceRecord | dict[str, Any]],
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS,
    *,
    model: str = DEFAULT_MODEL,
) -> IdealHits:
    """Cached tokens if every earlier prompt's blocks were still cached, wherever needed.

    One unlimited cache shared by every replica: a full block of a prompt counts as cached when
    an earlier prompt (same model namespace) had the same chained block. Like vLLM (and the
    simulated replica), the last prompt token is always computed, so at most
    (prompt_tokens - 1) // block_size_tokens blocks are reused.
    """
    seen: set[int] = set()
    prompt_total = cached_total = 0
    for record in sorted(trace, key=lambda r: r["t_s"]):
        text = prompt_text(record)
        n_tokens = approx_tokens(text)
        namespace = str(record.get("model", model))
        hashes = block_hashes(text, block_size_tokens=block_size_tokens, namespace=namespace)
        reusable = hashes[: (n_tokens - 1) // block_size_tokens]
        hit_blocks = 0
        for h in reusable:  # chained: the first unseen block ends the cached prefix
            if h not in seen:
                break
            hit_blocks += 1
        seen.update(hashes)
        prompt_total += n_tokens
        cached_total += hit_blocks * block_size_tokens
    return IdealHits(prompt_total, cached_total)


def ideal_hit_rate(
    trace: Iterable[TraceRecord | dict[str, Any]],
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS,
    *,
    model: str = DEFAULT_MODEL,
) -> float:
    """Cached tokens / prompt tokens with an unlimited cache everywhere: no router beats it."""
    return ideal_hits(trace, block_size_tokens, model=model).hit_rate


# --- files and CLI ---------------------------------------------------------------------------


def write_trace(trace: Sequence[TraceRecord], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for record in trace:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")


def read_trace(path: Path) -> list[TraceRecord]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.workloads.traces",
        description="Generate a seeded request trace (JSONL) and print its ideal prefix hit rate.",
    )
    parser.add_argument("--shape", default="mixed", choices=[*SHAPES, "mixed"])
    parser.add_argument("--rate", type=float, default=20.0, help="arrivals per second (Poisson)")
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--block-size-tokens", type=int, default=DEFAULT_BLOCK_SIZE_TOKENS)
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSONL trace")
    args = parser.parse_args(argv)
    trace = shape_trace(
        args.shape,
        rate_per_s=args.rate,
        duration_s=args.duration_s,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    write_trace(trace, args.out)
    hits = ideal_hits(trace, args.block_size_tokens)
    print(
        f"{len(trace)} requests, {hits.prompt_tokens} prompt tokens -> {args.out}\n"
        f"ideal prefix hit rate: {hits.hit_rate:.1%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
