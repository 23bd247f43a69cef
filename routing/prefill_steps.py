"""A request's queue and prefill on a replica that schedules as vLLM V1 does (routing/cost.py).

The queue and the prefill follow vLLM V1's scheduler (vllm/v1/core/sched/scheduler.py,
`Scheduler.schedule()`, vLLM 0.32.0), from the pool's declared engine flags (`EngineSettings`,
named as vLLM's): each step has a token budget (`max_num_batched_tokens`); RUNNING requests are
served first, each with the rest of its prompt capped at `long_prefill_token_threshold` (when
> 0, and only when more than one request is there) and at the budget left; a running decode
takes one token; then WAITING requests in policy order (`--scheduling-policy priority`: lower
first, then arrival) with what is left, a first chunk may be partial. Every request in a step
gets its tokens when the step ends, so prefills sharing a step finish together. Hence:

- the work ahead is replayed in time (`queue_wait_s`) at the rate of full steps (step cost +
  budget * s per token, for the budget less the decodes); a request sent with an engine priority
  overtakes known work of a less urgent one that has not started (one that was waiting when the
  step under way was formed and that step reached has: it got a partial first chunk; with a
  threshold, one that joined while a seat was free has);
- without a threshold a running prefill takes the whole budget it needs: a request behind it
  waits for all of it, and shares its first step with the tail of the work ahead and its last
  step with the work queued behind it;
- with a threshold (< the budget) a request gets budget a step after it arrives when fewer than
  budget / threshold prefills run, and its prefill takes at least tokens / threshold steps,
  stretched by the prefills sharing them (each taking up to the threshold per step).

The replica's progress is `Load.busy_s`, the time since the head of its queue started; the step
under way is placed by it as if every step since had been full. With nothing to prefill ahead
and decodes running, a request waits for the decode step under way (`decode_step_rest_s`): its
end is placed from the last step end the gateway saw on the replica's streams.
"""

from __future__ import annotations

from math import ceil
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from routing.cost import CostTerms, EngineSettings, Load


class StepShape(NamedTuple):
    """A replica's engine steps at its current load, from its flags and cost terms."""

    budget: int  # prefill tokens a step can take: max_num_batched_tokens less the decodes
    decodes: int  # running decodes, one token of each step's budget each
    threshold: int  # long_prefill_token_threshold when it caps below the budget, else 0
    step_s: float  # a step's fixed cost
    per_token_s: float
    full_s: float  # a full step: step_s + max_num_batched_tokens * per_token_s
    token_s: float  # seconds per prefill token while steps are full (the queue's drain rate)


def step_shape(engine: EngineSettings, terms: CostTerms, load: Load) -> StepShape:
    """The steps of a replica under `load`: requests sent and not past their first token are
    prefilling (the known queue, and one more for tokens of unknown requests); the rest of
    `in_flight` decode, up to max_num_seqs and a budget that leaves one prefill token."""
    known = len(load.queue)
    prefilling = known + (1 if load.pending_prefill_tokens > _known_tokens(load) else 0)
    decodes = load.in_flight - prefilling
    limit = engine.max_num_batched_tokens - 1
    limit = engine.max_num_seqs if engine.max_num_seqs < limit else limit
    decodes = 0 if decodes < 0 else limit if decodes > limit else decodes
    budget = engine.max_num_batched_tokens - decodes
    threshold = engine.long_prefill_token_threshold
    per = terms.prefill_s_per_token
    full_s = terms.step_s + engine.max_num_batched_tokens * per
    cap = threshold if 0 < threshold < budget else 0
    return StepShape(budget, decodes, cap, terms.step_s, per, full_s, full_s / budget)


def _known_tokens(load: Load) -> int:
    return sum(q.tokens for q in load.queue) if load.queue else 0


class Ahead(NamedTuple):
    """The replay's view from the request's first chunk: what is ahead of it and behind it."""

    wait_s: float  # from when it joins until the work ahead of it is done, at full steps
    work_tokens: float  # that work, in prefill tokens
    done_tokens: float  # prefill tokens computed since the head started (its progress)
    overtakes: int
    behind: tuple[int, ...]  # tokens of known requests it overtakes (waiting behind it)
    running: tuple[float, ...]  # remaining tokens of each request ahead (capped prefills only)


Own = tuple[float, float, float, int, float, int]
"""A request's steps: (queue_s: until the step of its first chunk starts, prefill_s: its own
steps, queue_steps: the full steps it waits for, prefill_steps, co_tokens: the tokens computed
in all those steps other than its own, overtakes: known requests of a less urgent priority it
goes before). A plain tuple: built per candidate per request, and a NamedTuple's constructor is
a Python call."""


def schedule(
    load: Load,
    joins_in_s: float,
    engine: EngineSettings,
    terms: CostTerms,
    uncached: int,
    priority: int | None,
) -> Own:
    """A request's steps on a replica under `load`, reaching the prefill `joins_in_s` from now
    with `uncached` tokens to compute."""
    if not load.queue and (
        load.pending_prefill_tokens <= 0 or not engine.long_prefill_token_threshold
    ):
        return _unqueued(load, joins_in_s, engine, terms, uncached)
    shape = step_shape(engine, terms, load)
    ahead = replay_ahead(load, joins_in_s, shape, priority)
    return own_steps(uncached, ahead, shape)


def _unqueued(
    load: Load, joins_in_s: float, engine: EngineSettings, terms: CostTerms, uncached: int
) -> Own:
    """schedule() when no known request joins and no capped prefill is under way: the general
    path's arithmetic, inline (it runs per candidate per request; tuples and calls cost more
    than the arithmetic). Conditionals rather than min() / max() for the same reason."""
    pending = load.pending_prefill_tokens
    budget = engine.max_num_batched_tokens
    decodes = load.in_flight - (1 if pending > 0 else 0)
    limit = budget - 1 if budget - 1 < engine.max_num_seqs else engine.max_num_seqs
    d = 0 if decodes < 0 else limit if decodes > limit else decodes
    e = budget - d
    step_s, per = terms.step_s, terms.prefill_s_per_token
    own = uncached if uncached > 0 else 1  # vLLM computes the last prompt token at least
    wait_s = 0.0
    if pending > 0:
        token_s = (step_s + budget * per) / e
        work_s = pending * token_s
        busy_s = load.busy_s
        wait_s = work_s - (busy_s if busy_s < work_s else work_s) - joins_in_s
    if wait_s <= 0.0:  # nothing ahead: alone unless decodes run (then a threshold caps it)
        cap = engine.long_prefill_token_threshold
        n = -(-own // cap) if d and 0 < cap < e else -(-own // e)
        return 0.0, n * step_s + (uncached + n * d) * per, 0.0, n, n * d, 0
    done = pending - wait_s / token_s
    tail = pending % e if pending // e != done // e else 0  # the step under way holds the rest
    n = -(-(tail + own) // e)
    queue_s = wait_s - tail * token_s
    if queue_s < 0.0:
        queue_s = 0.0
    queue_steps = queue_s / (step_s + budget * per)
    co_tokens = tail + n * d
    prefill_s = n * step_s + (uncached + co_tokens) * per
    return queue_s, prefill_s, queue_steps, n, co_tokens + queue_steps * budget, 0


def own_steps(uncached: int, ahead: Ahead, shape: StepShape) -> Own:
    """The request's steps. Without a threshold it takes the budget after the work ahead: it
    shares its first step with that work's tail (none if the work ends within the step under
    way: a step's requests are fixed when it starts) and its last with the work queued behind
    it. With one and a seat free, see _capped; with no seat free, as without (an approximation:
    it waits for the work ahead)."""
    e, d = shape.budget, shape.decodes
    work = ahead.work_tokens
    alone = not work and not ahead.behind and not d  # vLLM lifts the cap for a lone request
    if shape.threshold and not alone and len(ahead.running) < e // shape.threshold:
        return _capped(uncached, ahead, shape)
    tail = 0.0
    if work > 0.0:
        position = ahead.done_tokens + work
        if position // e != ahead.done_tokens // e:
            tail = position % e
    own = uncached if uncached > 0 else 1  # vLLM computes the last prompt token at least
    n = ceil((tail + own) / e)
    room = n * e - tail - own
    behind = sum(ahead.behind) if ahead.behind else 0
    fill = behind if behind < room else room
    queue_s = ahead.wait_s - tail * shape.token_s
    queue_s = queue_s if queue_s > 0.0 else 0.0
    return _finish(uncached, queue_s, n, tail + fill, ahead.overtakes, shape)


def _capped(uncached: int, ahead: Ahead, shape: StepShape) -> Own:
    """own_steps with a threshold T and a seat free: its first chunk goes in the step after
    the one under way; every prefill then takes up to T per
    step, so its prefill lasts n >= tokens / T steps, more while it and the prefills sharing
    them (min(their rest, n T) each) need more than n budgets."""
    e, d, cap = shape.budget, shape.decodes, shape.threshold
    running = ahead.running
    queue_s = 0.0
    if ahead.work_tokens > 0.0:
        # the step under way: a lone prefill in it had the cap lifted
        lone = len(running) == 1 and not d
        first_step = running[0] if lone else sum(r if r < cap else cap for r in running)
        under_way = first_step if first_step < e else e
        under_way_s = shape.step_s + (under_way + d) * shape.per_token_s
        # its rest, if every step since the head started was alike
        left_s = under_way_s - (ahead.done_tokens * shape.token_s) % under_way_s
        queue_s = left_s if ahead.wait_s > left_s else ahead.wait_s
    own = uncached if uncached > 0 else 1
    n = ceil(own / cap)
    shared = 0.0
    for _ in range(64):  # the fixed point of n = ceil(tokens in its n steps / budget); bounded
        most = n * cap
        shared = sum(r if r < most else most for r in running)
        needed = ceil((own + shared) / e)
        if needed <= n:
            break
        n = needed
    most = n * cap
    room = n * e - own - shared
    behind = sum(b if b < most else most for b in ahead.behind)
    fill = behind if behind < room else (room if room > 0 else 0)
    return _finish(uncached, queue_s, n, shared + fill, ahead.overtakes, shape)


def _finish(
    uncached: int, queue_s: float, n: int, shared: float, overtakes: int, shape: StepShape
) -> Own:
    """The request's terms from its wait, its n steps and the prefill tokens sharing them."""
    queue_steps = queue_s / shape.full_s
    decodes = n * shape.decodes
    prefill_s = n * shape.step_s + (uncached + shared + decodes) * shape.per_token_s
    waited = queue_steps * (shape.budget + shape.decodes)  # the tokens of the steps waited for
    return queue_s, prefill_s, queue_steps, n, waited + shared + decodes, overtakes


def queue_wait_s(
    load: Load, joins_in_s: float, per_token_s: float, priority: int | None = None
) -> float:
    """How long a request that reaches the prefill `joins_in_s` from now waits for the work
    ahead of it, each prefill token taking `per_token_s`: the replica's prefill replayed in
    arrival order (first come, first served, like vLLM's default scheduling policy), starting
    from what already waits (the queue's unknown part) less the progress on the head, then every
    known request joining first, or joining later but before the prefill is free for this one:
    it was sent first, and vLLM's waiting queue is in arrival order (a request is skipped only
    while its KV loads).

    With a `priority` (vLLM's --scheduling-policy priority, lower first), a known request sent
    with a larger one is overtaken unless its prefill starts before this one joins: a prefill
    that has started is not interrupted (vLLM schedules its RUNNING requests before any waiting
    one, vllm/v1/core/sched/scheduler.py). Work of unknown priority (other gateways') is counted
    as ahead."""
    shape = StepShape(1, 0, 0, 0.0, per_token_s, per_token_s, per_token_s)
    return replay_ahead(load, joins_in_s, shape, priority).wait_s


STALE_STEPS = 1.5
# No token on the replica's streams for this many decode steps while some decode: the step under
# way is not a decode step the gateway can place (work it does not know of, tokens read late),
# and no wait is counted for it.


def decode_step_rest_s(load: Load, joins_in_s: float) -> float:
    """What is left, when a request with no prefill ahead joins `joins_in_s` from now, of the
    step under way on a replica that runs only decodes: vLLM forms a step from what waits when
    the previous one ends, so a request that arrives during a decode step waits for its end
    (vllm/v1/engine/core.py, EngineCore.step: schedule, execute, then the next schedule).
    Steps follow one another, each `decode_step_s` long, from the last end seen, while the
    streams decode (`decodes_for_s`)."""
    step_s = load.decode_step_s
    ago_s = load.step_ended_ago_s
    if load.in_flight <= 0 or step_s <= 0.0 or ago_s is None or ago_s > STALE_STEPS * step_s:
        return 0.0
    joins_s = joins_in_s if joins_in_s > 0.0 else 0.0
    if joins_s >= load.decodes_for_s:
        return 0.0  # their last tokens will have come: nothing decodes when it joins
    return step_s - (ago_s + joins_s) % step_s


_NOTHING_AHEAD = Ahead(0.0, 0.0, 0.0, 0, (), ())


def replay_ahead(load: Load, joins_in_s: float, shape: StepShape, priority: int | None) -> Ahead:
    """queue_wait_s at the drain rate of full steps, and what the request's steps share. The
    replay is written out (no helper calls, conditionals rather than min() / max()): it runs per
    candidate per request."""
    if not load.queue:  # nothing known to join: the replay below, in closed form
        return _closed_form(load, joins_in_s, shape)
    token_s = shape.token_s
    unknown = load.pending_prefill_tokens - _known_tokens(load)
    progress_s = busy_s = load.busy_s  # progress: what is left of it to credit to the head
    free_at_s = 0.0  # when the prefill is free of the work replayed so far, from now
    sizes: list[float] = []  # tokens of each request ahead
    if unknown > 0:  # tokens of unknown requests: waiting now, the head's progress is theirs
        work_s = unknown * token_s
        done_s = progress_s if progress_s < work_s else work_s
        progress_s -= done_s
        free_at_s = work_s - done_s
        sizes.append(unknown)
    # with a threshold, a request that has joined runs within a step while seats are free
    seats = shape.budget // shape.threshold if shape.threshold else 0
    # the step under way took, after the running prefills, the requests waiting when it was
    # formed, as far as its budget went (partial first chunks): those are running
    formed_s = -(busy_s % shape.full_s) if busy_s > 0.0 else 0.0
    under_way_end_s = formed_s + shape.full_s
    joined_s = joins_in_s if joins_in_s > 0.0 else 0.0
    overtakes = 0
    behind: list[int] = []
    for q in sorted(load.queue, key=_joins):
        q_joins_s = q.joins_in_s
        # Every known request was sent before this one: vLLM's waiting queue is in arrival
        # order and skips a request only while its KV loads. One that joins after this one is
        # still ahead if it is loaded before the prefill is free for this one (unless a seat
        # is free: with a threshold this one then runs the step after it joins).
        if q_joins_s > joins_in_s and (q_joins_s > free_at_s or len(sizes) < seats):
            break
        start_s = free_at_s if free_at_s > q_joins_s else q_joins_s
        if (
            priority is not None
            and (q.priority or 0) > priority
            and start_s >= joined_s
            and not (start_s <= 0 and progress_s > 0)  # the head, already prefilling
            and len(sizes) >= seats  # no seat free: it is still waiting
            and not (q_joins_s <= formed_s and start_s < under_way_end_s)
        ):
            overtakes += 1
            behind.append(q.tokens)
            continue
        work_s = q.tokens * token_s
        done_s = 0.0
        if start_s <= 0:  # waiting already: the head's progress may be its
            done_s = progress_s if progress_s < work_s else work_s
            progress_s -= done_s
        free_at_s = start_s + work_s - done_s
        sizes.append(q.tokens)
    wait_s = free_at_s - joins_in_s
    if wait_s <= 0.0:
        return Ahead(0.0, 0.0, 0.0, overtakes, tuple(behind), ())
    work = wait_s / token_s
    running = _shared_out(sizes, sum(sizes) - work) if shape.threshold else ()
    return Ahead(wait_s, work, (busy_s + joined_s) / token_s, overtakes, tuple(behind), running)


_joins = attrgetter("joins_in_s")


def _shared_out(sizes: list[float], done: float) -> tuple[float, ...]:
    """What each request ahead has left when `done` of their tokens are computed with a
    threshold: every running prefill advances alike (up to the cap per step), so the progress
    is shared out evenly, the smallest finishing first (water-filling)."""
    level = 0.0
    left = len(sizes)
    for size in sorted(sizes):
        if (size - level) * left >= done:
            level += done / left
            break
        done -= (size - level) * left
        level = size
        left -= 1
    return tuple(size - level for size in sizes if size > level)


def _closed_form(load: Load, joins_in_s: float, shape: StepShape) -> Ahead:
    """replay_ahead when no known request joins the queue: what is queued (less the progress on the
    head) drains first. Conditionals rather than min() / max(): this runs per candidate per
    request, and a builtin call costs more than the arithmetic it guards."""
    pending = load.pending_prefill_tokens
    if pending <= 0:
        return _NOTHING_AHEAD
    token_s = shape.token_s
    work_s = pending * token_s
    busy_s = load.busy_s
    wait_s = work_s - (busy_s if busy_s < work_s else work_s) - joins_in_s
    if wait_s <= 0.0:
        return _NOTHING_AHEAD
    work = wait_s / token_s
    return Ahead(wait_s, work, pending - work, 0, (), (work,) if shape.threshold else ())
