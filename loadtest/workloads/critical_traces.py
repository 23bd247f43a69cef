"""The seeded trace of loadtest/bench/critical.py: four tenants on one busy fleet.

  voice  critical  voice calls: one fixed system prompt, short spoken turns, the previous short
                   answer appended each turn (chat).
  agent  critical  agent loops: one of a few tool-definition prompts, then a scratchpad that grows
                   every step (thought, action, observation) (completions).
  chat   standard  multi-turn chat over a few apps' system prompts, and RAG questions over a set of
                   shared documents (Zipf popularity) (chat).
  bulk   standard  one-off prompts that share nothing (chat).

Each tenant is its own Poisson process of `Mix.rates_per_s`; a multi-turn tenant continues the
session that has been ready the longest (its previous turn is over, by a conservative service-time
bound plus a think time) or starts a new one, as loadtest/workloads/traces.py does. Records are
loadtest.workloads.traces.TraceRecord; `tenant` is one of TENANTS, whose class and API key are here.

`round_robin_load()` estimates the fleet's prefill utilisation under round robin: it replays the
trace's prompts over the replicas in arrival order against block LRUs of the fleet's HBM and CPU
capacities and the shared remote tier (what the simulator keeps), and divides the tokens left to
prefill by what the fleet prefills in the trace's duration.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtest.sim.steps import Arrival, StepSettings, replay
from loadtest.workloads.traces import (
    AGENT_TOOLS_HEAD,
    CHAT_SYSTEM_HEAD,
    DOCUMENT_HEAD,
    ServiceBound,
    TraceRecord,
    between,
    numbered_texts,
    prompt_text,
    unique_text,
    words_text,
    zipf_weights,
)
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS, block_hashes
from routing.prompt import approx_tokens
from routing.whatif.cache import BlockLRU
from routing.whatif.summary import percentile

# --- tenants ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    tenant_class: str  # gateway TenantClass value: critical | standard
    api_key: str


TENANTS: dict[str, Tenant] = {
    t.name: t
    for t in (
        Tenant("voice", "critical", "voice-critical-key-1-0123456789abcdef0123456789"),
        Tenant("agent", "critical", "agent-critical-key-1-0123456789abcdef0123456789"),
        Tenant("chat", "standard", "chat-standard-key-1-0123456789abcdef0123456789"),
        Tenant("bulk", "standard", "bulk-standard-key-1-0123456789abcdef0123456789"),
    )
}
CLASSES = ("critical", "standard")

# --- sizes (tokens) --------------------------------------------------------------------------
# As in loadtest/workloads/traces.py: plausible production shapes at a small scale, not measured
# ones.

VOICE_SYSTEM_TOKENS = 800  # a voice agent's persona, rules and tools, the same in every call
VOICE_USER_TOKENS = (8, 40)  # one spoken sentence, transcribed
VOICE_REPLY_TOKENS = 30  # the previous spoken answer, appended to the conversation
VOICE_TURNS = (3, 8)
VOICE_THINK_MEAN_S = 1.5  # the caller listens to the answer, then speaks again
VOICE_MAX_TOKENS = 12  # the first words of the spoken answer: TTFT is what the caller hears

AGENT_APPS = 4
AGENT_TOOLS_TOKENS = (1_500, 2_500)
AGENT_TASK_TOKENS = (40, 160)
AGENT_THOUGHT_TOKENS = 60  # placeholder model output per step (thought + action), fixed
AGENT_OBSERVATION_TOKENS = (200, 800)  # tool output appended per step
AGENT_STEPS = (3, 10)
AGENT_THINK_MEAN_S = 0.3  # a tool call between two steps
# Contexts grow to ~2-10k tokens: they fit one replica's HBM (HBM_TOKENS in bench_critical.py)
# a few at a time, so where the next step lands decides whether its prefix is still there.
AGENT_MAX_TOKENS = 16

CHAT_APPS = 6
CHAT_SYSTEM_TOKENS = (800, 1_500)
CHAT_USER_TOKENS = (100, 400)
CHAT_REPLY_TOKENS = 200
CHAT_TURNS = (3, 10)
CHAT_THINK_MEAN_S = 1.0
RAG_SHARE = 0.4  # of the chat tenant's arrivals: a RAG question instead of a chat turn
RAG_DOCUMENTS = 40
RAG_DOCUMENT_TOKENS = (1_000, 3_000)
RAG_ZIPF_S = 1.1
RAG_QUESTION_TOKENS = (15, 60)
CHAT_MAX_TOKENS = 16

BULK_TOKENS = (1_500, 4_000)  # one-off documents to summarise or classify: nothing to reuse
BULK_MAX_TOKENS = 16

MAX_RECORDS = 100_000  # bounds every generator whatever its rate and duration


@dataclass(frozen=True, slots=True)
class Mix:
    """Arrivals per second per tenant."""

    rates_per_s: dict[str, float] = field(
        default_factory=lambda: {"voice": 3.5, "agent": 5.0, "chat": 5.5, "bulk": 3.0}
    )
    # ~17 requests/s. With bench_critical.py's fleet (6 replicas x 4000 prefill tokens/s) over
    # 30 s: ~0.8-0.95 of the fleet's prefill under round robin (round_robin_load; 0.89 for seed 1)
    # and the two critical tenants carry 47-52% of the prompt tokens, over seeds 1-4.
    # bench_critical prints both for every run.


# --- shared prefixes -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Shared:
    voice_system: str
    agent_tools: list[str]
    chat_systems: list[str]
    documents: list[str]
    doc_weights: list[float]

    @classmethod
    def build(cls, seed: int) -> _Shared:
        rng = random.Random(f"critical-shared-{seed}")
        voice = "You are the voice agent of a train operator. " + words_text(
            rng, VOICE_SYSTEM_TOKENS
        )
        tools = numbered_texts(rng, AGENT_APPS, AGENT_TOOLS_HEAD, AGENT_TOOLS_TOKENS)
        chats = numbered_texts(rng, CHAT_APPS, CHAT_SYSTEM_HEAD, CHAT_SYSTEM_TOKENS)
        docs = numbered_texts(rng, RAG_DOCUMENTS, DOCUMENT_HEAD, RAG_DOCUMENT_TOKENS)
        weights = zipf_weights(RAG_DOCUMENTS, RAG_ZIPF_S)
        return cls(voice, tools, chats, docs, weights)


# --- sessions: each yields (endpoint, messages or prompt, max_tokens) per turn ----------------

Turn = tuple[str, Any, int]
Session = Iterator[Turn]


def _voice_call(rng: random.Random, shared: _Shared) -> Session:
    messages = [{"role": "system", "content": shared.voice_system}]
    for turn in range(between(rng, VOICE_TURNS)):
        if turn:
            messages.append({"role": "assistant", "content": words_text(rng, VOICE_REPLY_TOKENS)})
        user = words_text(rng, between(rng, VOICE_USER_TOKENS))
        messages.append({"role": "user", "content": user})
        yield "chat", list(messages), VOICE_MAX_TOKENS


def _agent_loop(rng: random.Random, shared: _Shared) -> Session:
    tools = shared.agent_tools[rng.randrange(len(shared.agent_tools))]
    prompt = tools + "\nTask: " + words_text(rng, between(rng, AGENT_TASK_TOKENS))
    for _ in range(between(rng, AGENT_STEPS)):
        prompt += "\nThought:"
        yield "completions", prompt, AGENT_MAX_TOKENS
        prompt += " " + words_text(rng, AGENT_THOUGHT_TOKENS)
        prompt += "\nObservation: " + words_text(rng, between(rng, AGENT_OBSERVATION_TOKENS))


def _chat_session(rng: random.Random, shared: _Shared) -> Session:
    system = shared.chat_systems[rng.randrange(len(shared.chat_systems))]
    messages = [{"role": "system", "content": system}]
    for turn in range(between(rng, CHAT_TURNS)):
        if turn:
            messages.append({"role": "assistant", "content": words_text(rng, CHAT_REPLY_TOKENS)})
        messages.append(
            {"role": "user", "content": words_text(rng, between(rng, CHAT_USER_TOKENS))}
        )
        yield "chat", list(messages), CHAT_MAX_TOKENS


def _rag_question(rng: random.Random, shared: _Shared) -> Session:
    doc = rng.choices(shared.documents, weights=shared.doc_weights)[0]
    question = words_text(rng, between(rng, RAG_QUESTION_TOKENS))
    messages = [
        {"role": "system", "content": "Answer from the document below."},
        {"role": "user", "content": f"{doc}\n\nQuestion: {question}"},
    ]
    yield "chat", messages, CHAT_MAX_TOKENS


def _bulk_prompt(rng: random.Random, shared: _Shared) -> Session:
    text = unique_text(rng, BULK_TOKENS)
    yield "chat", [{"role": "user", "content": text}], BULK_MAX_TOKENS


@dataclass(frozen=True, slots=True)
class _Shape:
    factory: Callable[[random.Random, _Shared], Session]
    multi_turn: bool
    think_mean_s: float = 0.0


@dataclass
class _Active:
    conversation: str
    turns: Session
    ready_at_s: float


def _tenant_trace(
    tenant: str,
    shapes: Sequence[tuple[_Shape, float]],
    rate_per_s: float,
    duration_s: float,
    seed: int,
    shared: _Shared,
    bound: ServiceBound,
) -> list[TraceRecord]:
    rng = random.Random(f"critical-{tenant}-{seed}")
    active: dict[int, list[_Active]] = {i: [] for i in range(len(shapes))}
    weights = [w for _, w in shapes]
    trace: list[TraceRecord] = []
    t_s, started = 0.0, 0
    limit = min(MAX_RECORDS, math.ceil(rate_per_s * duration_s * 4) + 100)
    while rate_per_s > 0 and len(trace) < limit:
        t_s += rng.expovariate(rate_per_s)
        if t_s >= duration_s:
            break
        which = rng.choices(range(len(shapes)), weights=weights)[0]
        shape = shapes[which][0]
        ready = [a for a in active[which] if a.ready_at_s <= t_s]
        turn: Turn | None = None
        session = min(ready, key=lambda a: a.ready_at_s) if ready else None
        if session is not None:
            turn = next(session.turns, None)
            if turn is None:
                active[which].remove(session)
        if session is None or turn is None:
            started += 1
            factory_rng = random.Random(f"critical-{tenant}-{seed}-session-{started}")
            session = _Active(f"{tenant}-{started}", shape.factory(factory_rng, shared), t_s)
            turn = next(session.turns)
            if shape.multi_turn:
                active[which].append(session)
        endpoint, content, max_tokens = turn
        record: TraceRecord = {
            "t_s": round(t_s, 6),
            "tenant": tenant,
            "endpoint": "chat" if endpoint == "chat" else "completions",
            "max_tokens": max_tokens,
            "conversation": session.conversation if shape.multi_turn else None,
        }
        if endpoint == "chat":
            record["messages"] = content
        else:
            record["prompt"] = content
        think = rng.expovariate(1.0 / shape.think_mean_s) if shape.think_mean_s else 0.0
        session.ready_at_s = (
            t_s + bound.seconds(approx_tokens(prompt_text(record)), max_tokens) + think
        )
        trace.append(record)
    return trace


TENANT_SHAPES: dict[str, list[tuple[_Shape, float]]] = {
    "voice": [(_Shape(_voice_call, True, VOICE_THINK_MEAN_S), 1.0)],
    "agent": [(_Shape(_agent_loop, True, AGENT_THINK_MEAN_S), 1.0)],
    "chat": [
        (_Shape(_chat_session, True, CHAT_THINK_MEAN_S), 1.0 - RAG_SHARE),
        (_Shape(_rag_question, False), RAG_SHARE),
    ],
    "bulk": [(_Shape(_bulk_prompt, False), 1.0)],
}


def critical_trace(
    mix: Mix, duration_s: float, seed: int, bound: ServiceBound
) -> list[TraceRecord]:
    """Every tenant's records, merged by arrival offset."""
    unknown = set(mix.rates_per_s) - set(TENANTS)
    if unknown:
        raise ValueError(f"unknown tenants {sorted(unknown)}; known: {sorted(TENANTS)}")
    shared = _Shared.build(seed)
    trace: list[TraceRecord] = []
    for tenant, rate in mix.rates_per_s.items():
        trace += _tenant_trace(tenant, TENANT_SHAPES[tenant], rate, duration_s, seed, shared, bound)
    return sorted(trace, key=lambda r: (r["t_s"], r["tenant"]))


# --- what the trace asks of the fleet --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadEstimate:
    requests: dict[str, int]  # per tenant
    prompt_tokens: dict[str, int]  # per tenant
    rr_uncached_tokens: int  # left to prefill under round robin
    fleet_prefill_tokens: float  # what the fleet prefills in the trace's duration

    @property
    def total_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens.values())

    @property
    def critical_token_share(self) -> float:
        crit = sum(
            v for k, v in self.prompt_tokens.items() if TENANTS[k].tenant_class == "critical"
        )
        return crit / self.total_prompt_tokens if self.total_prompt_tokens else 0.0

    @property
    def raw_utilisation(self) -> float:
        """Every prompt token prefilled: no cache at all."""
        return self.total_prompt_tokens / self.fleet_prefill_tokens

    @property
    def rr_utilisation(self) -> float:
        return self.rr_uncached_tokens / self.fleet_prefill_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "critical_prompt_token_share": self.critical_token_share,
            "round_robin_uncached_tokens": self.rr_uncached_tokens,
            "fleet_prefill_tokens_in_duration": self.fleet_prefill_tokens,
            "utilisation_no_cache": self.raw_utilisation,
            "utilisation_round_robin": self.rr_utilisation,
        }


@dataclass(frozen=True, slots=True)
class ReplicaShape:
    hbm_tokens: int
    cpu_tokens: int  # 0: no CPU tier
    remote: bool  # reads and writes the shared remote tier
    prefill_tokens_per_s: float


def round_robin_load(
    trace: Sequence[TraceRecord],
    replicas: Sequence[ReplicaShape],
    duration_s: float,
    *,
    model: str,
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS,
) -> LoadEstimate:
    """Prefill tokens left under round robin, with the simulator's bookkeeping: per replica an HBM
    LRU whose overflow goes to the CPU LRU, one shared remote tier of unlimited size; a prompt
    reuses its leading blocks found in HBM, then CPU, then remote (fetching them always beats
    recomputing at the fleet's costs, by ~5x), and its last token is always computed."""
    bs = block_size_tokens
    hbm = [BlockLRU(r.hbm_tokens // bs) for r in replicas]
    cpu = [BlockLRU(r.cpu_tokens // bs) if r.cpu_tokens else None for r in replicas]
    remote: set[int] = set()
    requests: dict[str, int] = {}
    prompt_tokens: dict[str, int] = {}
    uncached = 0
    for i, record in enumerate(sorted(trace, key=lambda r: r["t_s"])):
        k = i % len(replicas)
        text = prompt_text(record)
        n = approx_tokens(text)
        hashes = block_hashes(text, block_size_tokens=bs, namespace=model)
        reusable = hashes[: (n - 1) // bs]
        g = hbm[k].prefix_len(reusable)
        tier = cpu[k]
        c = tier.prefix_len(reusable, g) if tier is not None else 0
        m = 0
        if replicas[k].remote:
            for h in reusable[g + c :]:
                if h not in remote:
                    break
                m += 1
        uncached += n - (g + c + m) * bs
        evicted = hbm[k].insert(reversed(hashes))
        if tier is not None:
            tier.touch(reversed(reusable[g : g + c]))
            tier.insert(evicted)
        if replicas[k].remote:
            remote.update(hashes)
        tenant = record["tenant"]
        requests[tenant] = requests.get(tenant, 0) + 1
        prompt_tokens[tenant] = prompt_tokens.get(tenant, 0) + n
    capacity = duration_s * sum(r.prefill_tokens_per_s for r in replicas)
    return LoadEstimate(requests, prompt_tokens, uncached, capacity)


@dataclass(frozen=True, slots=True)
class Floor:
    """The TTFT no router can beat on this trace (ms), per class and overall, and per request."""

    ttft_ms: dict[str, list[float]]  # per class, and "all"
    per_request: list[float | None] = field(default_factory=list)  # trace order; None: warm-up

    def p(self, group: str, q: float) -> float:
        return percentile(self.ttft_ms.get(group, []), q)

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {
            g: {"p50_ms": self.p(g, 50), "p90_ms": self.p(g, 90), "p99_ms": self.p(g, 99)}
            for g in self.ttft_ms
        }


def alone_ms(tokens: int, prefill_tokens_per_s: float, steps: StepSettings | None) -> float:
    """A prefill of `tokens` on an idle replica: tokens / rate on the one-at-a-time engine
    (steps None); on a step engine, the steps it takes alone (steps.replay: vLLM lifts the
    long-prefill threshold for a request that is alone, so chunks of the whole budget), each
    with its fixed cost."""
    if steps is None:
        return 1000 * tokens / prefill_tokens_per_s
    [first] = replay(steps, [Arrival(0.0, max(1, tokens))])
    assert first is not None  # never cancelled
    return 1000 * first


def ideal_floor(
    trace: Sequence[TraceRecord],
    prefill_tokens_per_s: float,
    *,
    model: str,
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS,
    since_s: float = 0.0,
    steps: StepSettings | None = None,
) -> Floor:
    """Each request's own prefill with a perfect cache and no queue: every leading block that any
    earlier request of the trace held is reused for free (whatever replica, tier or timing), the
    rest is prefilled alone at full speed (and the last token always, as the simulator does), in
    the engine's steps when `steps` is given (alone_ms). A lower bound of any arm's TTFT: a
    request's first use of a prefix cannot be cached. Requests before `since_s` (a warm-up) fill
    the cache but are not counted. `per_request` is in the order of `trace`."""
    bs = block_size_tokens
    seen: set[int] = set()
    out: dict[str, list[float]] = {"all": []}
    per_request: list[float | None] = [None] * len(trace)
    for i in sorted(range(len(trace)), key=lambda j: trace[j]["t_s"]):
        record = trace[i]
        text = prompt_text(record)
        n = approx_tokens(text)
        hashes = block_hashes(text, block_size_tokens=bs, namespace=model)
        reused = 0
        for h in hashes[: (n - 1) // bs]:
            if h not in seen:
                break
            reused += 1
        seen.update(hashes)
        if record["t_s"] < since_s:
            continue
        ms = alone_ms(n - reused * bs, prefill_tokens_per_s, steps)
        per_request[i] = ms
        tenant = TENANTS.get(record["tenant"])  # a trace of other tenants: "all" only
        if tenant is not None:
            out.setdefault(tenant.tenant_class, []).append(ms)
        out["all"].append(ms)
    return Floor(out, per_request)
