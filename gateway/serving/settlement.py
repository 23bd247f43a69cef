"""Settle a request once: the work after a replica's answer, for streamed and whole answers alike.

What happened to a request sent to a replica reaches a list of observers, built once at wiring
time (`observers`), as llm-d's PostResponse plugins see each answer:

- `on_accepted`: the replica took the request (status < 400), before its first byte;
- `on_first_byte`: a streamed answer's first byte arrived (its prefill is done);
- `on_settled`: the answer ended, however it ended (its last byte, a broken stream, a client gone,
  a whole answer read or not): a `Settled` record says what was seen. The proxy calls it exactly
  once per answer it relayed; a try abandoned before its answer (a retry onto the next replica,
  an upstream error before the first byte) is not settled, its reservation only released.

The proxy relays and reports; each observer is one concern (the index, the cost accounting,
capture, learning, rate limits, metrics). Adding one is a class here and a line in `observers`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from gateway.accounting.calibration import CostLearner, Observation
from gateway.serving import slo
from gateway.serving.usage import StreamReader, Usage, usage_in
from gateway.telemetry import logs
from gateway.telemetry.metrics import Metrics

if TYPE_CHECKING:
    from gateway.accounting.capture import Capture
    from gateway.accounting.ledger import CostAccounting
    from gateway.fleet.replica import Replica, Reservation
    from gateway.serving.planner import Plan, Planner
    from gateway.tenancy.rate_limits import RateLimiter


def prefill_only(plan: Plan) -> bool:
    """A request for at most one token: its whole answer comes at its first token."""
    limit = plan.body.get("max_tokens", plan.body.get("max_completion_tokens"))
    return isinstance(limit, int) and limit <= 1


@dataclass(slots=True)
class Settled:
    """What one answer from one replica turned out to be.

    `answered`: the replica's answer reached the gateway (status < 400, and a whole answer's
    body was read; a stream counts however it ended); `ttft_s`: an observed time to first token,
    or None when there is none (a stream without a first byte, a whole answer that generated
    more than one token: its first byte came after the whole generation); `head_s`: a whole
    answer's time from sending to its response head (its TTFT as a client without streaming
    sees it); `usage`: the engine's usage (a stream: read from its events by `reader`, which
    also says when its last token came)."""

    plan: Plan
    reservation: Reservation
    status: int
    streamed: bool
    answered: bool = True
    ttft_s: float | None = None
    head_s: float | None = None
    whole_usage: Usage | None = None
    reader: StreamReader = field(default_factory=StreamReader)
    broke: bool = False  # a stream that began and broke mid-way (its replica failed it)

    @property
    def replica(self) -> Replica:
        return self.reservation.replica

    @property
    def usage(self) -> Usage | None:
        return self.reader.usage if self.streamed else self.whole_usage

    @property
    def cached_tokens(self) -> int | None:
        usage = self.usage
        return usage.cached_tokens if usage is not None else None

    @property
    def prompt_tokens(self) -> int | None:
        usage = self.usage
        return usage.prompt_tokens if usage is not None else None

    @property
    def output_tokens(self) -> int | None:
        usage = self.usage
        return usage.completion_tokens if usage is not None else None

    def time_per_output_token_s(self) -> float | None:
        """(last token - first token) / (output tokens - 1) of a stream: its decode pace."""
        first_s, last_s = self.reservation.first_byte_s, self.reader.last_token_s
        tokens = self.output_tokens
        if not self.streamed or first_s is None or last_s is None or tokens is None:
            return None
        if tokens < 2 or last_s < first_s:
            return None
        return (last_s - first_s) / (tokens - 1)


def whole_answer(
    plan: Plan,
    reservation: Reservation,
    status: int,
    ttft_s: float,
    content: bytes | None,
    head_s: float | None = None,
) -> Settled:
    """A whole answer's record: `content` its body, None when it could not be read; `ttft_s`
    the time to its first byte, a TTFT only for a prefill-only request (otherwise the first
    byte came after the whole generation); `head_s` the time to its response head."""
    settled = Settled(plan, reservation, status, streamed=False, answered=False, head_s=head_s)
    if content is not None:
        settled.answered = status < 400
        settled.ttft_s = ttft_s if prefill_only(plan) else None
        if settled.answered:
            settled.whole_usage = usage_in(content)
    return settled


class Observer:
    """A post-response observer; each hook does nothing unless overridden. Hooks must not
    raise for a request's own reasons (an index error is counted and logged, not raised):
    the answer is already on its way to the client."""

    async def on_accepted(self, plan: Plan, replica: Replica) -> None:
        return None

    async def on_first_byte(self, plan: Plan, reservation: Reservation, ttft_s: float) -> None:
        return None

    def on_settled(self, settled: Settled) -> None:
        return None


class Settlement:
    """The observers, run in their order at each step of an answer (each step calls only the
    observers that do something there: a no-op hook is not awaited per request)."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = tuple(observers)
        self._accepted = [o.on_accepted for o in self.observers if _overrides(o, "on_accepted")]
        self._first_byte = [
            o.on_first_byte for o in self.observers if _overrides(o, "on_first_byte")
        ]
        self._settled = [o.on_settled for o in self.observers if _overrides(o, "on_settled")]

    async def accepted(self, plan: Plan, replica: Replica) -> None:
        for hook in self._accepted:
            await hook(plan, replica)

    async def accepted_while_reading(
        self, plan: Plan, replica: Replica, chunks: AsyncIterator[bytes]
    ) -> tuple[bytes | None, asyncio.Future[None] | None]:
        """`accepted`, run while a stream's first chunk is read: the acceptance's work (the
        index's record of the prompt sent) needs no byte of the answer, and the replica's
        prefill is time the request waits anyway. Returns the first chunk (None: the stream was
        empty) and the acceptance, when it is still running then (a replica that answered at
        once): the first chunk goes to the client before it (relay_response.py
        `OpenStream.first_sent`). A read that fails or finds the stream empty waits for the
        acceptance here."""
        accepted = asyncio.ensure_future(self.accepted(plan, replica))
        try:
            first = await anext(chunks, None)
        except BaseException:
            await finish_shielded(accepted)
            raise
        if first is None:
            await finish_shielded(accepted)
            return None, None
        if accepted.done():  # mostly, by the first chunk: its outcome without a cancel scope
            accepted.result()
            return first, None
        return first, accepted

    async def first_byte(self, plan: Plan, reservation: Reservation, ttft_s: float) -> None:
        for hook in self._first_byte:
            await hook(plan, reservation, ttft_s)

    def settle(self, settled: Settled) -> None:
        for hook in self._settled:
            hook(settled)


async def finish_shielded(work: asyncio.Future[None] | None) -> None:
    """Wait for `work` (None: nothing) to end, even in a task being cancelled; its error, if it
    failed, is raised."""
    if work is None:
        return
    if not work.done():
        with anyio.CancelScope(shield=True):
            await work
    work.result()


def _overrides(observer: Observer, hook: str) -> bool:
    return getattr(type(observer), hook) is not getattr(Observer, hook)


class IndexConfirmation(Observer):
    """The index learns where the prompt now lives: at acceptance (Planner.record_sent), or
    when its KV load is estimated to be done, at the latest at its first byte (record_loaded) or
    its end (settle_loaded)."""

    def __init__(self, planner: Planner) -> None:
        self._planner = planner

    async def on_accepted(self, plan: Plan, replica: Replica) -> None:
        await self._planner.record_sent(plan, replica)

    async def on_first_byte(self, plan: Plan, reservation: Reservation, ttft_s: float) -> None:
        await self._planner.record_loaded(plan, reservation.replica)

    def on_settled(self, settled: Settled) -> None:
        self._planner.settle_loaded(settled.plan, answered=settled.answered)


class TtftMetrics(Observer):
    """cachelane_ttft_seconds{mode} and the estimated queue wait of every answer.

    mode="stream": a request that asked to stream, at its first byte (an answer that came whole,
    an error's, at its end), with its per-tenant twin cachelane_tenant_ttft_seconds;
    mode="whole": a request that did not, at its answer's response head, which an engine sends
    once the whole generation is done: the TTFT such a client sees, not a prefill time."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    async def on_first_byte(self, plan: Plan, reservation: Reservation, ttft_s: float) -> None:
        self._observe(plan, reservation.replica.name, ttft_s)

    def on_settled(self, settled: Settled) -> None:
        if settled.streamed:  # seen at its first byte
            return
        plan, r = settled.plan, settled.reservation
        name = r.replica.name
        if plan.stream:
            first_byte_s = r.first_byte_s if r.first_byte_s is not None else r.started_s
            self._observe(plan, name, first_byte_s - r.started_s)
            return
        if settled.answered and settled.head_s is not None:
            self._metrics.ttft_seconds.labels(name, plan.model, "whole").observe(settled.head_s)
        self._observe_queue(plan, name)

    def _observe(self, plan: Plan, name: str, ttft_s: float) -> None:
        if plan.stream:
            self._metrics.ttft_seconds.labels(name, plan.model, "stream").observe(ttft_s)
            tenant = plan.tenant
            self._metrics.tenant_ttft_seconds.labels(
                tenant.name, tenant.tenant_class.value
            ).observe(ttft_s)
        self._observe_queue(plan, name)

    def _observe_queue(self, plan: Plan, name: str) -> None:
        queue_s = plan.decision.score(name).estimate.queue_s
        self._metrics.estimated_queue.labels(name).observe(queue_s)


class RateLimitUsage(Observer):
    """Tokens per minute: the estimate charged at admission corrected by the engine's usage; a
    stream that ended without its usage (a client that left early, a replica that broke off) is
    charged the output it sent, as its token events count it."""

    def __init__(self, limits: RateLimiter) -> None:
        self._limits = limits

    def on_settled(self, settled: Settled) -> None:
        if settled.answered:
            plan, usage = settled.plan, settled.usage
            raw = usage.raw if usage is not None else None
            sent = settled.reader.token_events if settled.streamed else 0
            self._limits.on_usage(plan.tenant, plan.prompt_tokens, raw, sent_tokens=sent)


class UsageMetrics(Observer):
    """From the engine's usage: cachelane_prompt_tokens and cachelane_cached_tokens (whose
    ratio is the observed hit rate; an answer without cached_tokens counts 0) and
    cachelane_output_tokens; from a stream's events, cachelane_time_per_output_token_seconds.
    An answer without usage counts nothing (the proxy asks a stream for it:
    gateway/serving/usage.py). The access line gets the engine's counts too."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def on_settled(self, settled: Settled) -> None:
        usage = settled.usage
        if not settled.answered or usage is None:
            return
        logs.note_usage(usage.prompt_tokens, usage.cached_tokens)
        plan = settled.plan
        labels = (settled.replica.name, plan.tenant.name, plan.model)
        prompt = usage.prompt_tokens
        if prompt is not None:
            self._metrics.prompt_tokens.labels(*labels).inc(prompt)
            self._metrics.cached_tokens.labels(*labels).inc(min(usage.cached_tokens or 0, prompt))
        if usage.completion_tokens is not None:
            self._metrics.output_tokens.labels(*labels).inc(usage.completion_tokens)
        tpot_s = settled.time_per_output_token_s()
        if tpot_s is not None:
            self._metrics.time_per_output_token.labels(labels[0], plan.model).observe(tpot_s)


class CostObserver(Observer):
    """The cost accounting (gateway/accounting/ledger.py): the remote tier's traffic at acceptance,
    the answer's cost at its end."""

    def __init__(self, costs: CostAccounting) -> None:
        self._costs = costs

    async def on_accepted(self, plan: Plan, replica: Replica) -> None:
        self._costs.sent(plan, replica)

    def on_settled(self, settled: Settled) -> None:
        if settled.answered:
            self._costs.answered(
                settled.plan,
                settled.replica,
                settled.ttft_s,
                settled.cached_tokens,
                settled.prompt_tokens,
            )


class CaptureObserver(Observer):
    """The traffic capture (gateway/accounting/capture.py): one record per answer."""

    def __init__(self, capture: Capture) -> None:
        self._capture = capture

    def on_settled(self, settled: Settled) -> None:
        if settled.answered:
            self._capture.answered(
                settled.plan,
                settled.reservation,
                status=settled.status,
                ttft_s=settled.ttft_s,
                cached_tokens=settled.cached_tokens,
                prompt_tokens=settled.prompt_tokens,
            )


class Learning(Observer):
    """The cost model learns from every observed TTFT (gateway/accounting/calibration.py), in
    batches off the request: the observation is queued, the fit solved after the stream closed."""

    def __init__(self, learner: CostLearner) -> None:
        self._learner = learner

    def on_settled(self, settled: Settled) -> None:
        # a stream its replica broke: a failing replica's fast first byte must not make it look fast
        if settled.answered and settled.ttft_s is not None and not settled.broke:
            plan, replica = settled.plan, settled.replica
            observation = Observation(
                replica,
                plan.decision.score(replica.name),
                settled.ttft_s,
                settled.cached_tokens,
                plan.decision.candidate(replica.name),
                plan.engine_priority(replica),
                max(s.overlap.cached_tokens for s in plan.decision.scores),
            )
            self._learner.queue(observation)


class ObjectiveAttainment(Observer):
    """cachelane_slo_attained_total: a streamed request with a TTFT objective met it or not, by
    the TTFT its client saw (gateway/serving/slo.py)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    async def on_first_byte(self, plan: Plan, reservation: Reservation, ttft_s: float) -> None:
        slo.observe_first_byte(self._metrics, plan, reservation.started_s, ttft_s)


def observers(
    planner: Planner,
    metrics: Metrics,
    learner: CostLearner,
    *,
    costs: CostAccounting | None = None,
    capture: Capture | None = None,
    limits: RateLimiter | None = None,
) -> Settlement:
    """The post-response observers, in the order they run: the one list, built at wiring."""
    chain: list[Observer] = [
        TtftMetrics(metrics),
        ObjectiveAttainment(metrics),
        IndexConfirmation(planner),
    ]
    if limits is not None:
        chain.append(RateLimitUsage(limits))
    chain.append(UsageMetrics(metrics))
    if costs is not None:
        chain.append(CostObserver(costs))
    if capture is not None:
        chain.append(CaptureObserver(capture))
    chain.append(Learning(learner))
    return Settlement(chain)
