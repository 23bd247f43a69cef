"""Locust user classes for cachelane: one per workload shape, streaming through raw SSE.

Every request streams (`stream: true`, `stream_options.include_usage`) and is one Locust request
(POST, named after its shape: the full response time, to the end of the stream, failures
included). A refused request is named by its status and error code (outcomes.failure_name), and
its user waits out the answer's Retry-After before its next request. Its time to the first
chunk carrying generated text (the role-only first chat chunk does not count) and its usage's
cached and prompt tokens go to outcomes.py, beside Locust's request statistics.

Shapes reuse loadtest/workloads/traces.py's session generators, so Locust and the replay benchmarks
send the same kind of text: chat (per-app system prompts, growing conversations), agent (long tool
prompt, growing scratchpad, /v1/completions), rag (Zipf-popular shared documents, unique questions),
unique (nothing shared), shared_system (one system prompt for everyone) and voice (a
latency-critical tenant: short system prompt, short turns, short answers).
"""

from __future__ import annotations

import itertools
import json
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from locust import HttpUser, between, constant, tag, task
from locust.exception import StopUser
from requests.exceptions import RequestException

from loadtest.bench.replay import PATHS, has_text, streaming_body
from loadtest.locust.outcomes import OUTCOMES, failure_name, retry_after_s
from loadtest.workloads import mooncake, traces
from loadtest.workloads.scenarios import voice_session

VOICE_MAX_TOKENS = 16  # a voice answer starts speaking after a few tokens; TTFT is what counts

_user_ids = itertools.count()
_shared_by_seed: dict[int, Any] = {}


def shared_prefixes(seed: int) -> Any:
    """The system prompts, tool prompts and documents every user of this seed shares."""
    if seed not in _shared_by_seed:
        _shared_by_seed[seed] = traces._Shared.build(random.Random(f"{seed}-shared"))
    return _shared_by_seed[seed]


class StreamingUser(HttpUser):
    """Base class: one session generator per user, each task sends its next turn."""

    abstract = True
    shape: ClassVar[str] = ""  # traces.SHAPES key, or "voice"
    key_option: ClassVar[str] = ""  # parsed option holding this tenant's API key
    max_tokens: ClassVar[int] = traces.MAX_TOKENS

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.model: str = getattr(options, "model", traces.DEFAULT_MODEL)
        self.seed: int = int(getattr(options, "seed", 1))
        worker = getattr(self.environment.runner, "worker_index", 0)
        self.rng = random.Random(f"{self.seed}-{worker}-{self.shape}-{next(_user_ids)}")
        key = getattr(options, self.key_option, "") or getattr(options, "api_key", "")
        self.headers = {"authorization": f"Bearer {key}"} if key else {}
        self.turns: Iterator[traces.Request] = iter(())

    def new_session(self) -> Iterator[traces.Request]:
        factory = traces.SHAPES[self.shape]
        return factory(random.Random(self.rng.getrandbits(64)), shared_prefixes(self.seed))

    def next_request(self) -> traces.Request:
        request = next(self.turns, None)
        if request is None:
            self.turns = self.new_session()
            request = next(self.turns)
        return request

    def send_turn(self) -> None:
        request = self.next_request()
        endpoint = request["endpoint"]
        body = streaming_body(request, self.model, self.max_tokens)
        self.stream(PATHS[endpoint], endpoint, body)

    def stream(self, path: str, endpoint: str, body: dict[str, Any]) -> None:
        name = self.shape
        started = time.perf_counter()
        ttft_ms: float | None = None
        usage: dict[str, Any] | None = None
        size = 0
        with self.client.post(
            path, json=body, headers=self.headers, stream=True, catch_response=True, name=name
        ) as resp:
            if resp.status_code != 200:
                resp.failure(failure_name(resp.status_code, resp.text))
                wait_s = retry_after_s(resp.headers)
                if wait_s:
                    time.sleep(wait_s)  # cooperative: Locust runs users on gevent's patched time
                return
            problem = None
            try:
                # chunk_size=None: each HTTP chunk as it arrives (a size would wait to fill it)
                for line in resp.iter_lines(chunk_size=None):
                    size += len(line)
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        problem = f"stream error: {str(chunk['error'])[:200]}"
                        break
                    if ttft_ms is None and has_text(chunk, endpoint):
                        ttft_ms = (time.perf_counter() - started) * 1000
                    usage = chunk.get("usage") or usage
            except (RequestException, ValueError) as err:
                problem = f"{type(err).__name__}: {err}"
            resp.request_meta["response_time"] = (time.perf_counter() - started) * 1000
            resp.request_meta["response_length"] = size
            if problem is None and usage is None:
                problem = "no usage chunk in the stream"
            if problem is not None:
                resp.failure(problem)
                return
            resp.success()
        self.report(name, ttft_ms, usage)

    def report(self, name: str, ttft_ms: float | None, usage: dict[str, Any] | None) -> None:
        if usage is None:
            return
        details = usage.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
        OUTCOMES.add(name, ttft_ms, int(usage.get("prompt_tokens") or 0), cached)


class ChatUser(StreamingUser):
    """Multi-turn chat: 8 apps with their own system prompts; conversations grow every turn."""

    shape = "chat"
    key_option = "chat_api_key"
    weight = 3
    wait_time = between(0.5, 2.0)

    @tag("chat", "standard")
    @task
    def turn(self) -> None:
        self.send_turn()


class AgentUser(StreamingUser):
    """Agentic loop: a long tool prompt and a scratchpad that grows every step."""

    shape = "agentic"
    key_option = "agent_api_key"
    weight = 3
    wait_time = between(0.2, 1.0)

    @tag("agent", "standard")
    @task
    def step(self) -> None:
        self.send_turn()


class RagUser(StreamingUser):
    """RAG: one of 80 shared documents (Zipf popularity) plus a unique question."""

    shape = "rag"
    key_option = "rag_api_key"
    weight = 2
    wait_time = between(0.5, 2.0)

    @tag("rag", "standard")
    @task
    def ask(self) -> None:
        self.send_turn()


class UniqueUser(StreamingUser):
    """Unique single-turn prompts: nothing to reuse, for any router."""

    shape = "unique"
    key_option = "unique_api_key"
    weight = 1
    wait_time = between(0.5, 2.0)

    @tag("unique", "standard")
    @task
    def one_off(self) -> None:
        self.send_turn()


class SharedSystemUser(StreamingUser):
    """Every conversation shares one long system prompt (the hot-spot case)."""

    shape = "shared_system"
    key_option = "chat_api_key"
    weight = 1
    wait_time = between(0.5, 2.0)

    @tag("shared_system", "standard")
    @task
    def turn(self) -> None:
        self.send_turn()


class VoiceUser(StreamingUser):
    """A latency-critical voice tenant: short turns, short answers; its TTFT is what matters."""

    shape = "voice"
    key_option = "voice_api_key"
    max_tokens = VOICE_MAX_TOKENS
    weight = 1
    wait_time = between(0.3, 1.0)

    def new_session(self) -> Iterator[traces.Request]:
        return voice_session(random.Random(self.rng.getrandbits(64)), self.seed)

    @tag("voice", "critical")
    @task
    def speak(self) -> None:
        self.send_turn()


class TraceSchedule:
    """One process's replay of a trace: each record is handed out once, at its offset from the
    first hand-out (every TraceUser of the process shares it)."""

    def __init__(self, records: Sequence[traces.TraceRecord]) -> None:
        self.records = records
        self.next = 0
        self.started: float | None = None

    def take(self) -> tuple[traces.TraceRecord, float] | None:
        """The next record and the perf_counter time it is due at; None once all are out."""
        if self.next >= len(self.records):
            return None
        if self.started is None:
            self.started = time.perf_counter()
        record = self.records[self.next]
        self.next += 1
        return record, self.started + record["t_s"]


_schedules: dict[tuple[str, float], TraceSchedule] = {}


def trace_schedule(spec: str, time_scale: float) -> TraceSchedule:
    """The process's schedule of `--trace` (loadtest/workloads/mooncake.py's `load`)."""
    key = (spec, time_scale)
    if key not in _schedules:
        _schedules[key] = TraceSchedule(mooncake.load(spec, time_scale=time_scale))
    return _schedules[key]


class TraceUser(StreamingUser):
    """Replays `--trace` (a Mooncake file, `mooncake:PATH[@START:COUNT]`, or a JSONL trace of
    this project's): each user sends the next record at its offset, so the trace's arrivals
    set the pace as long as enough users are free (-u at least the requests in flight). The
    only user class when --trace is given, and never otherwise (locustfile.py)."""

    shape = "trace"
    wait_time = constant(0)

    def on_start(self) -> None:
        super().on_start()
        options = self.environment.parsed_options
        scale = float(getattr(options, "trace_time_scale", 1.0))
        self.schedule = trace_schedule(str(getattr(options, "trace", "")), scale)

    @tag("trace")
    @task
    def replay(self) -> None:
        taken = self.schedule.take()
        if taken is None:
            raise StopUser()
        record, due = taken
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # cooperative: Locust runs users on gevent's patched time
        body = streaming_body(record, self.model, record["max_tokens"])
        self.stream(PATHS[record["endpoint"]], record["endpoint"], body)


STANDARD_USERS: tuple[type[StreamingUser], ...] = (
    ChatUser,
    AgentUser,
    RagUser,
    UniqueUser,
    SharedSystemUser,
)
ALL_USERS: tuple[type[StreamingUser], ...] = (*STANDARD_USERS, VoiceUser)
