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

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.accounting.calibration import CostLearner, Observation
from gateway.serving import slo
from gateway.telemetry.metrics import Metrics

if TYPE_CHECKING:
    from gateway.accounting.capture import Capture
    from gateway.accounting.ledger import CostAccounting
    from gateway.fleet.registry import Replica, Reservation
    from gateway.serving.planner import Plan, Planner
    from gateway.tenancy.rate_limits import RateLimiter

_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')


def cached_tokens_in(chunk: bytes) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` if this piece of a response carries it."""
    if b"cached_tokens" not in chunk:
        return None
    match = _CACHED_TOKENS.search(chunk)
    return int(match.group(1)) if match else None


def prompt_tokens_in(chunk: bytes) -> int | None:
    """`usage.prompt_tokens` (/v1/responses: `input_tokens`) if this piece of a response
    carries it."""
    if b"_tokens" not in chunk:
        return None
    match = _PROMPT_TOKENS.search(chunk)
    return int(match.group(1)) if match else None


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
    more than one token: its first byte came after the whole generation); `usage`: the last
    piece of the answer that carried the engine's usage (a whole answer: its body)."""

    plan: Plan
    reservation: Reservation
    status: int
    streamed: bool
    answered: bool = True
    ttft_s: float | None = None
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    usage: bytes | None = None

    @property
    def replica(self) -> Replica:
        return self.reservation.replica

    def saw(self, chunk: bytes) -> None:
        """A piece of a streamed answer went by: keep what its usage says."""
        found = cached_tokens_in(chunk)
        if found is not None:
            self.cached_tokens = found
        if (tokens := prompt_tokens_in(chunk)) is not None:
            self.prompt_tokens, self.usage = tokens, chunk


def whole_answer(
    plan: Plan, reservation: Reservation, status: int, ttft_s: float, content: bytes | None
) -> Settled:
    """A whole answer's record: `content` its body, None when it could not be read; `ttft_s`
    the time to its first byte, a TTFT only for a prefill-only request (otherwise the first
    byte came after the whole generation)."""
    settled = Settled(plan, reservation, status, streamed=False, answered=False)
    if content is not None:
        settled.answered = status < 400
        settled.ttft_s = ttft_s if prefill_only(plan) else None
        settled.cached_tokens = cached_tokens_in(content)
        settled.prompt_tokens = prompt_tokens_in(content)
        settled.usage = content
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

    async def first_byte(self, plan: Plan, reservation: Reservation, ttft_s: float) -> None:
        for hook in self._first_byte:
            await hook(plan, reservation, ttft_s)

    def settle(self, settled: Settled) -> None:
        for hook in self._settled:
            hook(settled)


def _overrides(observer: Observer, hook: str) -> bool:
    return getattr(type(observer), hook) is not getattr(Observer, hook)


class IndexConfirmation(Observer):
    """The index learns where the prompt now lives: at acceptance (Planner.record_sent), and
    the blocks a stream loads at its first byte, when its prefill is done (record_loaded)."""

    def __init__(self, planner: Planner) -> None:
        self._planner = planner

    async def on_accepted(self, plan: Plan, replica: Replica) -> None:
        await self._planner.record_sent(plan, replica)

    async def on_first_byte(self, plan: Plan, reservation: Reservation, ttft_s: float) -> None:
        await self._planner.record_loaded(plan, reservation.replica)


class TtftMetrics(Observer):
    """cachelane_ttft_seconds and its per-tenant twin for a request that asked to stream (at
    its first byte; an answer that came whole, an error's, at its end) and the estimated queue
    wait of every answer."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    async def on_first_byte(self, plan: Plan, reservation: Reservation, ttft_s: float) -> None:
        self._observe(plan, reservation.replica.name, ttft_s)

    def on_settled(self, settled: Settled) -> None:
        if settled.streamed:  # seen at its first byte
            return
        r = settled.reservation
        first_byte_s = r.first_byte_s if r.first_byte_s is not None else r.started_s
        self._observe(settled.plan, r.replica.name, first_byte_s - r.started_s)

    def _observe(self, plan: Plan, name: str, ttft_s: float) -> None:
        if plan.stream:  # a whole answer's first byte comes after the whole generation
            self._metrics.ttft_seconds.labels(name, plan.model).observe(ttft_s)
            tenant = plan.tenant
            self._metrics.tenant_ttft_seconds.labels(
                tenant.name, tenant.tenant_class.value
            ).observe(ttft_s)
        queue_s = plan.decision.score(name).estimate.queue_s
        self._metrics.estimated_queue.labels(name).observe(queue_s)


class RateLimitUsage(Observer):
    """Tokens per minute: the estimate charged at admission corrected by the engine's usage."""

    def __init__(self, limits: RateLimiter) -> None:
        self._limits = limits

    def on_settled(self, settled: Settled) -> None:
        if settled.answered:
            plan = settled.plan
            self._limits.on_usage(plan.tenant, plan.prompt_tokens, settled.usage)


class UsageMetrics(Observer):
    """cachelane_prompt_tokens and cachelane_cached_tokens, whose ratio is the observed hit
    rate, from the engine's usage (the last one a stream sent). An answer without usage (a
    stream without include_usage) counts nothing; one without cached_tokens counts 0."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def on_settled(self, settled: Settled) -> None:
        prompt = settled.prompt_tokens
        if not settled.answered or prompt is None:
            return
        usage = settled.usage
        cached = (cached_tokens_in(usage) if usage is not None else None) or 0
        plan = settled.plan
        labels = (settled.replica.name, plan.tenant.name, plan.model)
        self._metrics.prompt_tokens.labels(*labels).inc(prompt)
        self._metrics.cached_tokens.labels(*labels).inc(min(cached, prompt))


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
    """The cost model learns from every observed TTFT (gateway/accounting/calibration.py)."""

    def __init__(self, learner: CostLearner) -> None:
        self._learner = learner

    def on_settled(self, settled: Settled) -> None:
        if settled.answered and settled.ttft_s is not None:
            score = settled.plan.decision.score(settled.replica.name)
            observation = Observation(settled.replica, score, settled.ttft_s, settled.cached_tokens)
            self._learner.observe(observation)


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
