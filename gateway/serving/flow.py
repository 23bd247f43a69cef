"""Class-aware flow control: requests that cannot be dispatched now wait in a bounded queue of
their class instead of piling onto an engine's queue.

A request is dispatchable when its `ready()` predicate is true: the best replica's estimated wait
fits its class's budget. When it is not (or when it would overtake a waiter), it waits here:

- between classes, critical first, then standard, then batch (TenantClass order);
- within a class, round robin over the tenants that have waiters, FIFO within a tenant;
- a new arrival never overtakes a waiter of its own or a higher class: if one exists, it queues
  even if its own ready() is true. Waiters of a lower class do not hold it back.

Each class has a bounded queue (`max_queue`: an arrival beyond it is shed at once) and a maximum
wait (`max_wait_s`: a waiter past it is shed). A shed raises `Shed` with the class, the reason and
a retry-after. A waiter whose task is cancelled (client gone) leaves the queue at once.

Contract with the gateway (nothing here knows about replicas; the load lives in `ready()`):

- `ready()` is synchronous, cheap, and raises nothing. It reads the gateway's current load view.
- `kick()` whenever load on a replica drops, and after a request that `admit()` let through has
  reserved its slot (or has given up without reserving). Reserve synchronously right after
  `admit()` returns, with no await in between.
- A kick dispatches at most ONE waiter per class: the head, i.e. the first waiter of the next
  tenant in round robin, and only if its ready() is true. A dispatched waiter is "handed off"
  until its task resumes; while a class has a hand-off pending, kicks dispatch nothing more of it
  and arrivals of that class or a lower one queue. Its load is not in the view yet, so a second
  dispatch would be decided on a stale view; the kick that follows its reservation moves on.
- `run()` kicks every `recheck_s` while waiters exist, so a missed kick delays a waiter by at most
  that much. `max_wait_s` is enforced on kicks and rechecks, against the injected clock, so a
  shed comes at most ~`recheck_s` late.

Known limit (by design, one head per class per kick): a head whose ready() stays false (say, its
model's replicas are all busy) holds back the rest of its class until it is dispatched or shed.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from routing.types import TenantClass

ShedReason = Literal["queue_full", "max_wait"]

ACTIVE_WINDOW_S = 30.0
# A class is held only while a more urgent one is active (arrived within this window, or waits):
# holding exists to give the engines' capacity to the more urgent first. Without one it only
# delays: on the family benchmark's overloaded member (python -m loadtest.bench.family, m02:
# one class, 3 replicas at 0.9 load) holding standard at its 1 s budget gave TTFT p50/p90
# 3,035/5,635 ms against 1,966/3,249 without it. 30 s: standard's longest hold (max_wait_s), so a
# more urgent request's precedence outlasts any hold it caused.
WAIT_WINDOW = 256  # waits kept per class for stats and retry-after: the last ~256 queued requests

_QUEUED, _HANDED_OFF, _GONE = 0, 1, 2  # a waiter's state; _GONE: shed, cancelled or failed


class Shed(Exception):
    """A request turned away by flow control; the gateway answers 503/429 with retry-after."""

    def __init__(self, tenant_class: TenantClass, reason: ShedReason, retry_after_s: int) -> None:
        super().__init__(
            f"{tenant_class.value} request shed ({reason}); retry after {retry_after_s} s"
        )
        self.tenant_class = tenant_class
        self.reason: ShedReason = reason
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ClassLimits:
    max_queue: int  # waiters of this class at most; 0: never queue, shed when not ready
    max_wait_s: float  # a waiter queued longer than this is shed

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, got {self.max_wait_s}")


@dataclass(eq=False, slots=True)
class _Waiter:
    tenant: str
    ready: Callable[[], bool]
    future: asyncio.Future[float]
    enqueued_s: float
    deadline_s: float
    state: int = _QUEUED


class _ClassState:
    """One class's queue: tenants in round-robin order, each with its FIFO of waiters."""

    def __init__(self, tenant_class: TenantClass, limits: ClassLimits) -> None:
        self.tenant_class = tenant_class
        self.limits = limits
        self.at_or_above: tuple[_ClassState, ...] = ()  # set by FlowControl, self included
        self.tenants: OrderedDict[str, deque[_Waiter]] = OrderedDict()
        self.depth = 0
        self.handoffs = 0
        self.next_expiry_s = math.inf  # no waiter expires before this (may be early, never late)
        self.seen_s = -math.inf  # when a request of the class last arrived
        self.dispatched = 0
        self.dispatched_queued = 0
        self.shed_queue_full = 0
        self.shed_max_wait = 0
        self.cancelled = 0
        self.waits: deque[float] = deque(maxlen=WAIT_WINDOW)
        self.waits_sum = 0.0

    def record_wait(self, waited_s: float) -> None:
        """Time spent queued by a waiter that left by dispatch or by max_wait."""
        if len(self.waits) == WAIT_WINDOW:
            self.waits_sum -= self.waits[0]
        self.waits.append(waited_s)
        self.waits_sum += waited_s

    def mean_wait_s(self) -> float:
        return max(0.0, self.waits_sum / len(self.waits)) if self.waits else 0.0

    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.mean_wait_s()))

    def push(self, w: _Waiter) -> None:
        dq = self.tenants.get(w.tenant)
        if dq is None:
            dq = self.tenants[w.tenant] = deque()
        dq.append(w)
        self.depth += 1
        self.next_expiry_s = min(self.next_expiry_s, w.deadline_s)

    def remove(self, w: _Waiter) -> None:
        dq = self.tenants[w.tenant]
        dq.remove(w)
        if not dq:
            del self.tenants[w.tenant]
        self.depth -= 1

    def pop_head(self, tenant: str, dq: deque[_Waiter], *, served: bool) -> _Waiter:
        """Take the first waiter of the head tenant; a served tenant goes to the back."""
        w = dq.popleft()
        if not dq:
            del self.tenants[tenant]
        elif served:
            self.tenants.move_to_end(tenant)
        self.depth -= 1
        return w


class FlowControl:
    def __init__(
        self,
        limits: Mapping[TenantClass, ClassLimits],
        *,
        clock: Callable[[], float] = time.monotonic,
        recheck_s: float = 0.05,
    ) -> None:
        missing = [c.value for c in TenantClass if c not in limits]
        if missing:
            raise ValueError(f"flow control limits missing for classes {missing}")
        if not recheck_s > 0:
            raise ValueError(f"recheck_s must be > 0, got {recheck_s}")
        self._clock = clock
        self._recheck_s = recheck_s
        self._order = tuple(_ClassState(c, limits[c]) for c in TenantClass)  # highest first
        for i, s in enumerate(self._order):
            s.at_or_above = self._order[: i + 1]
        self._classes = {s.tenant_class: s for s in self._order}
        self._total = 0  # queued waiters, all classes
        self._nonempty = asyncio.Event()  # set while _total > 0: run() sleeps otherwise

    async def admit(
        self, tenant: str, tenant_class: TenantClass, ready: Callable[[], bool]
    ) -> float:
        """Return once the request may be dispatched: seconds waited, 0.0 if at once.

        Raises Shed when the class's queue is full or the wait passed max_wait_s. The caller
        reserves its slot right away and then calls kick()."""
        if self.admit_now(tenant_class, ready):
            return 0.0
        return await self._wait(self._classes[tenant_class], tenant, ready)

    def admit_now(self, tenant_class: TenantClass, ready: Callable[[], bool]) -> bool:
        """admit()'s case of no wait, without an await (so the caller can decide and reserve in
        one step): True, counted as dispatched, when no request of the class or a higher one is
        queued or handed off and ready() holds."""
        state = self._classes[tenant_class]
        for s in state.at_or_above:
            if s.depth or s.handoffs:
                return False
        if not ready():
            return False
        state.dispatched += 1
        return True

    async def _wait(self, state: _ClassState, tenant: str, ready: Callable[[], bool]) -> float:
        if state.depth >= state.limits.max_queue:
            state.shed_queue_full += 1
            raise Shed(state.tenant_class, "queue_full", state.retry_after_s())
        now = self._clock()
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        w = _Waiter(tenant, ready, future, now, now + state.limits.max_wait_s)
        state.push(w)
        self._total += 1
        self._nonempty.set()
        try:
            waited = await future
        except asyncio.CancelledError:
            if w.state == _QUEUED:  # still in line: leave it; the next head may be ready
                w.state = _GONE
                state.remove(w)
                state.cancelled += 1
                self._left()
                self.kick()
            elif w.state == _HANDED_OFF:  # dispatched but never reserved: pass the turn on
                w.state = _GONE
                state.handoffs -= 1
                state.cancelled += 1
                self.kick()
            raise
        state.handoffs -= 1
        w.state = _GONE
        return waited

    def kick(self) -> None:
        """Re-examine the waiters: per class, shed the expired and dispatch the head if ready."""
        if not self._total:
            return
        now = self._clock()
        for state in self._order:
            if not state.depth:
                continue
            if now >= state.next_expiry_s:
                self._expire(state, now)
            if state.handoffs:
                continue
            while state.depth:
                tenant, dq = next(iter(state.tenants.items()))
                w = dq[0]
                if w.future.done():  # cancelled, its task has not run yet: drop it
                    state.pop_head(tenant, dq, served=False)
                    w.state = _GONE
                    state.cancelled += 1
                    self._left()
                    continue
                try:
                    ok = w.ready()
                except Exception as err:  # a broken predicate fails its own request only
                    state.pop_head(tenant, dq, served=False)
                    w.state = _GONE
                    self._left()
                    w.future.set_exception(err)
                    continue
                if ok:
                    state.pop_head(tenant, dq, served=True)
                    w.state = _HANDED_OFF
                    state.handoffs += 1
                    state.dispatched += 1
                    state.dispatched_queued += 1
                    waited = max(0.0, now - w.enqueued_s)
                    state.record_wait(waited)
                    self._left()
                    w.future.set_result(waited)
                break

    def _expire(self, state: _ClassState, now: float) -> None:
        """Shed every waiter past its deadline; the oldest of each tenant is at its front."""
        next_expiry = math.inf
        for tenant, dq in list(state.tenants.items()):
            while dq and dq[0].deadline_s <= now:
                w = state.pop_head(tenant, dq, served=False)
                w.state = _GONE
                self._left()
                if w.future.done():  # cancelled, its task has not run yet
                    state.cancelled += 1
                    continue
                state.shed_max_wait += 1
                state.record_wait(max(0.0, now - w.enqueued_s))
                w.future.set_exception(Shed(state.tenant_class, "max_wait", state.retry_after_s()))
            if dq:
                next_expiry = min(next_expiry, dq[0].deadline_s)
        state.next_expiry_s = next_expiry

    def _left(self) -> None:
        self._total -= 1
        if not self._total:
            self._nonempty.clear()

    def waiting(self) -> dict[str, int]:
        """Queue depth per class."""
        return {s.tenant_class.value: s.depth for s in self._order}

    def arrived(self, tenant_class: TenantClass) -> None:
        """A request of `tenant_class` asks to be dispatched (held or not)."""
        self._classes[tenant_class].seen_s = self._clock()

    def holds(self, tenant_class: TenantClass) -> bool:
        """Whether a request of `tenant_class` goes through the queue now: a strictly more
        urgent class arrived within ACTIVE_WINDOW_S (there is someone to hold it back for), or
        a request of its class or above is queued or handed off (it must not overtake it)."""
        now = self._clock()
        for s in self._order:
            if s.depth or s.handoffs:
                return True
            if s.tenant_class is tenant_class:
                return False
            if now - s.seen_s <= ACTIVE_WINDOW_S:
                return True
        return False

    def higher_class_waiting(self, tenant_class: TenantClass) -> bool:
        """True if a request of a strictly higher class than `tenant_class` is queued, or was
        dispatched and has not reserved yet."""
        for s in self._order:
            if s.tenant_class is tenant_class:
                return False
            if s.depth or s.handoffs:  # a hand-off's load is not in the view yet
                return True
        return False

    def stats(self) -> dict[str, dict[str, float]]:
        """Per class: depth, counters since start, the oldest waiter's age, and the wait of the
        last WAIT_WINDOW queued requests (dispatched or shed for max_wait; at-once dispatches
        are not in it)."""
        now = self._clock()
        out: dict[str, dict[str, float]] = {}
        for s in self._order:
            waits = sorted(s.waits)
            oldest = min((dq[0].enqueued_s for dq in s.tenants.values()), default=now)
            out[s.tenant_class.value] = {
                "depth": s.depth,
                "dispatched": s.dispatched,
                "dispatched_queued": s.dispatched_queued,
                "shed_queue_full": s.shed_queue_full,
                "shed_max_wait": s.shed_max_wait,
                "cancelled": s.cancelled,
                "oldest_wait_s": max(0.0, now - oldest),
                "wait_mean_s": s.mean_wait_s(),
                "wait_p50_s": _quantile(waits, 0.5),
                "wait_p99_s": _quantile(waits, 0.99),
                "retry_after_s": s.retry_after_s(),
            }
        return out

    async def run(self) -> None:
        """Safety recheck: kick every recheck_s while anything waits. Cancel to stop."""
        while True:
            await self._nonempty.wait()
            await asyncio.sleep(self._recheck_s)
            self.kick()


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
