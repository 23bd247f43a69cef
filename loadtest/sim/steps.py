"""vLLM V1's step scheduler, as a pure class: which requests get how many tokens in each step.

vllm/v1/core/sched/scheduler.py, `Scheduler.schedule()` (vLLM 0.32.0), read for this model:
  - each step has a token budget, `max_num_batched_tokens`;
  - RUNNING requests first, in the order they started: a decoding one takes 1 token, a prefilling
    one the rest of its prompt, capped at `long_prefill_token_threshold` when that is > 0 and at
    the budget left (vLLM 0.32.0 lifts the cap for a step that has only one request, running or
    waiting: nobody to starve);
  - then WAITING requests in policy order (`scheduling_policy` "fcfs": arrival; "priority": lower
    priority value first, then arrival), while there is budget and fewer than `max_num_seqs`
    requests run: each gets min(its uncached tokens, the threshold, the budget left), so a first
    chunk may be partial; a request whose KV is still loading (a CPU swap-in, a remote fetch:
    WAITING_FOR_REMOTE_KVS) is skipped and keeps its place;
  - the step is one forward pass: every request in it gets its tokens when it ends, so prefills
    that share a step finish together, one whose prompt is done has its first token then, and
    every decoding request its next token (vLLM streams a decode token per step: while a long
    prefill's steps run, the decodes beside it wait for each of them).
A step lasts `step_overhead_s + tokens / prefill_tokens_per_s`; one with no prompt token (only
decodes) at least `decode_step_s`, the replica's inter-token latency: a decode step is bound by
reading the weights and the batch's KV from HBM, not by its few tokens. A request that arrives
during a decode step waits for its end, as on vLLM. The class has no clock: a driver
(step_loop.py on asyncio, `replay()` below on a list of arrivals) runs a step for its duration
and then completes it. Preemption (when KV blocks run out) is not modelled: the simulated HBM
evicts cached blocks instead.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from routing.cost import PREFILL_TOKENS_PER_S

SchedulingPolicy = Literal["fcfs", "priority"]

VLLM_MAX_NUM_BATCHED_TOKENS = 8_192
VLLM_MAX_NUM_SEQS = 1_024
# vLLM 0.32.0, vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults: for the OpenAI API server
# (UsageContext.OPENAI_API_SERVER) on a GPU with 70-160 GiB that is not an A100 (H100, H200),
# max_num_batched_tokens 8192 and max_num_seqs 1024 (>= 160 GiB: 16384 and 1024; other GPUs: 2048
# and 256; CPU: 2048 and 128). The simulator's default replica is Llama-3.1-8B on one H200
# (141 GB, routing/cost.py).

VLLM_LONG_PREFILL_TOKEN_THRESHOLD = 0
# vLLM 0.32.0, vllm/config/scheduler.py, SchedulerConfig.long_prefill_token_threshold = 0 (off).

STEP_OVERHEAD_S = 0.0034
# What a step costs whatever its tokens: every forward pass reads all the weights from HBM once,
# 16.06 GB (Llama-3.1-8B, 8.03e9 parameters * 2 bytes in BF16) / 4.8 TB/s (H200 HBM3e, NVIDIA
# datasheet) = 3.4 ms. A lower bound: launch and sampling overheads add to it on a real engine.


def default_max_num_batched_tokens(prefill_tokens_per_s: float) -> int:
    """vLLM's default budget scaled to a simulated prefill rate, so that a full step lasts what
    it lasts on the hardware the default describes: 8192 tokens at the H200's ~30k tokens/s
    (routing.cost.PREFILL_TOKENS_PER_S) is ~273 ms; at 4k tokens/s the budget is 1092 tokens."""
    scaled = VLLM_MAX_NUM_BATCHED_TOKENS * prefill_tokens_per_s / PREFILL_TOKENS_PER_S
    return max(1, round(scaled))


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSettings:
    """A replica's scheduler flags, named as vLLM's, and the two constants of a step's time."""

    prefill_tokens_per_s: float
    max_num_batched_tokens: int = VLLM_MAX_NUM_BATCHED_TOKENS
    long_prefill_token_threshold: int = VLLM_LONG_PREFILL_TOKEN_THRESHOLD
    scheduling_policy: SchedulingPolicy = "fcfs"
    max_num_seqs: int = VLLM_MAX_NUM_SEQS
    step_overhead_s: float = STEP_OVERHEAD_S
    decode_step_s: float = 0.0  # the least a step of decodes only lasts (the replica's ITL)

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be > 0")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.step_overhead_s < 0:
            raise ValueError("step_overhead_s must be >= 0")
        if self.decode_step_s < 0:
            raise ValueError("decode_step_s must be >= 0")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be 'fcfs' or 'priority'")

    def step_s(self, tokens: int) -> float:
        return self.step_overhead_s + tokens / self.prefill_tokens_per_s


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    GONE = "gone"  # finished or cancelled


@dataclass(eq=False, slots=True)
class StepRequest:
    """One request as the scheduler sees it. `tokens`: the tokens it must compute; `resolve`,
    when given, is called as it is first scheduled and returns them then (a prefix cache lookup
    at that moment, as vLLM's get_computed_blocks)."""

    tokens: int
    priority: int = 0
    loading: bool = False  # its KV is still arriving: skipped, keeps its place
    resolve: Callable[[], int] | None = None
    on_start: Callable[[], None] | None = None  # first scheduled
    on_first_token: Callable[[], None] | None = None  # the step that ends its prefill ended
    on_token: Callable[[], None] | None = None  # a step that gave it a decode token ended
    # decode tokens it takes after its first (max_tokens - 1), then it is finished in the step
    # that gave the last, as vLLM's; None: it decodes until it leaves
    decode_steps: int | None = None
    decoded: int = 0
    computed: int = 0
    phase: Phase = Phase.WAITING
    arrival: int = 0  # set by add(): its place in arrival order


@dataclass(frozen=True, slots=True)
class Step:
    tokens: dict[StepRequest, int]  # the tokens each request computes in this step
    started: tuple[StepRequest, ...]  # those scheduled for the first time
    duration_s: float

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens.values())


@dataclass(slots=True)
class StepScheduler:
    settings: StepSettings
    waiting: list[StepRequest] = field(default_factory=list)
    running: list[StepRequest] = field(default_factory=list)  # prefilling and decoding, in order
    _arrivals: itertools.count[int] = field(default_factory=itertools.count)

    def add(self, request: StepRequest) -> None:
        request.arrival = next(self._arrivals)
        request.phase = Phase.WAITING
        self.waiting.append(request)

    def loaded(self, request: StepRequest) -> None:
        request.loading = False

    def cancel(self, request: StepRequest) -> None:
        """The request leaves: from the next step its budget is free (a step under way keeps it)."""
        self.finish(request)

    def finish(self, request: StepRequest) -> None:
        """The request is done (decode over, or cancelled) and leaves its queue."""
        if request.phase is Phase.WAITING and request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)
        request.phase = Phase.GONE

    def schedule(self) -> Step | None:
        """The next step, or None when it would compute no token: nothing runs, and nothing
        waiting can start (all loading, or no seat under max_num_seqs). Moves the requests it
        starts from waiting to running."""
        seat = len(self.running) < self.settings.max_num_seqs
        if not self.running and not (seat and any(not r.loading for r in self.waiting)):
            return None
        s = self.settings
        budget = s.max_num_batched_tokens
        threshold = s.long_prefill_token_threshold
        if len(self.running) + len(self.waiting) <= 1:
            threshold = 0  # vllm/v1/core/sched/scheduler.py 0.32.0: alone, nobody to starve
        tokens: dict[StepRequest, int] = {}
        for r in self.running:
            if budget <= 0:
                break
            remaining = r.tokens - r.computed
            n = 1 if r.phase is Phase.DECODING else _chunk(remaining, threshold, budget)
            tokens[r] = n
            budget -= n
        started: list[StepRequest] = []
        for r in self._policy_order():
            if budget <= 0 or len(self.running) >= s.max_num_seqs:
                break
            if r.loading:
                continue  # WAITING_FOR_REMOTE_KVS: skipped, keeps its place
            if r.resolve is not None:
                r.tokens = r.resolve()
            n = _chunk(r.tokens, threshold, budget)
            self.waiting.remove(r)
            self.running.append(r)
            r.phase = Phase.PREFILLING
            tokens[r] = n
            started.append(r)
            budget -= n
        total = sum(tokens.values())
        duration_s = s.step_s(total)
        if not started and all(r.phase is Phase.DECODING for r in tokens):
            duration_s = max(duration_s, s.decode_step_s)
        return Step(tokens, tuple(started), duration_s)

    def complete(self, step: Step) -> list[StepRequest]:
        """The step's forward pass ended: its requests get their tokens; returns those whose
        prefill it finished. A request that left during the step gets nothing; one that got
        its last token (decode_steps) is finished."""
        done: list[StepRequest] = []
        for r, n in step.tokens.items():
            if r.phase is Phase.DECODING:
                r.decoded += 1
                if r.decode_steps is not None and r.decoded >= r.decode_steps:
                    self.finish(r)
                continue
            if r.phase is not Phase.PREFILLING:
                continue
            r.computed += n
            if r.computed >= r.tokens:
                r.phase = Phase.DECODING
                done.append(r)
                if r.decode_steps == 0:
                    self.finish(r)
        return done

    def _policy_order(self) -> list[StepRequest]:
        if self.settings.scheduling_policy == "priority":
            return sorted(self.waiting, key=lambda r: (r.priority, r.arrival))
        return list(self.waiting)  # appended in arrival order


def _chunk(remaining: int, threshold: int, budget: int) -> int:
    if 0 < threshold < remaining:
        remaining = threshold
    return min(remaining, budget)


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request for `replay()`: when it arrives, its tokens to compute, and optionally when its
    KV finishes loading, when it is cancelled, and for how many steps it decodes after its first
    token (each taking 1 token of budget from the steps that prefill others)."""

    at_s: float
    tokens: int
    priority: int = 0
    loaded_at_s: float | None = None
    cancel_at_s: float | None = None
    decode_steps: int = 0


def replay(settings: StepSettings, arrivals: Sequence[Arrival]) -> list[float | None]:
    """Each arrival's first-token time (None: cancelled first) on a replica that runs the step
    loop from time 0: a discrete-event run of StepScheduler, with no wall clock."""
    if any(a.tokens < 1 for a in arrivals):
        raise ValueError("a request computes at least one token (vLLM computes the last one)")
    sched = StepScheduler(settings)
    requests = [StepRequest(a.tokens, a.priority, decode_steps=a.decode_steps) for a in arrivals]
    first: list[float | None] = [None] * len(arrivals)
    index = {id(r): i for i, r in enumerate(requests)}
    events: list[tuple[float, int, str]] = []  # (time, order, kind): arrivals before loads
    for i, a in enumerate(arrivals):
        events.append((a.at_s, i, "arrive"))
        if a.loaded_at_s is not None:
            requests[i].loading = True
            events.append((a.loaded_at_s, i, "loaded"))
        if a.cancel_at_s is not None:
            events.append((a.cancel_at_s, i, "cancel"))
    order = {"arrive": 0, "loaded": 1, "cancel": 2}
    events.sort(key=lambda e: (e[0], order[e[2]], e[1]))
    now, pending = 0.0, list(events)

    def apply_until(t: float) -> None:
        while pending and pending[0][0] <= t:
            _, i, kind = pending.pop(0)
            if kind == "arrive":
                sched.add(requests[i])
            elif kind == "loaded":
                sched.loaded(requests[i])
            else:
                sched.cancel(requests[i])

    for _ in range(1_000_000):  # bounded: every step computes a token, every request ends
        apply_until(now)
        step = sched.schedule()
        if step is None:
            if not pending:
                return first
            now = max(now, pending[0][0])
            continue
        end = now + step.duration_s
        apply_until(end - 1e-12)  # what happens during the step waits for the next one
        for r in sched.complete(step):
            first[index[id(r)]] = end
        now = end
    raise RuntimeError("replay did not finish")
