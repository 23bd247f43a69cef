"""Per-tenant rate limits: requests and tokens per minute (config `rate_limits`).

Each tenant has one budget per kind (requests, tokens), with the limits of its tenant entry, else
of its own class: a request that asks for a lower class (x-cachelane-class) lowers its priority,
never its accounting. The arithmetic is routing/ratelimit.py's GCRA. With the
Redis index the state of a budget is one Redis key, updated by a Lua script (the same arithmetic,
run atomically where the state lives, on Redis's clock), so every gateway spends from one budget.
Without Redis, or while Redis fails, each gateway keeps its own state: a request is never refused
or failed because Redis is down (during an outage every gateway enforces the whole limit by
itself, so together they may pass up to N times it).

Tokens: a request is charged its prompt's estimate (the planner's prompt_tokens) at admission and
corrected when its answer ends: by its `usage.total_tokens` (prompt and completion), else, for a
stream that ended without usage (the client left, the replica broke off), by the estimate plus
the token events it sent (one per engine step: a lower bound of its output).

Refusals are 429 `rate_limit_exceeded` in OpenAI's envelope (type `requests` or `tokens`) with
Retry-After, counted in cachelane_rate_limited_total{tenant,limit}.

Every answer to a limited tenant, refusals included, carries OpenAI's rate-limit headers
(`Budget.headers`): `x-ratelimit-limit-`, `-remaining-` and `-reset-requests` / `-tokens`, as
its admission left the budget. The reset is the time until the budget is full again, written as
OpenAI writes it (Go's duration format: "12ms", "1s", "6m0s"; platform.openai.com/docs/guides/
rate-limits, "Rate limits in headers").
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.http.errors import ApiError
from gateway.telemetry.metrics import Metrics
from gateway.tenancy.tenants import Tenant
from routing.ratelimit import admit, charge

if TYPE_CHECKING:
    from gateway.config import RateLimitsConfig

log = logging.getLogger("cachelane.limits")

REDIS_RETRY_S = 1.0  # after a failed Redis call, the local state decides for this long
_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')

# routing/ratelimit.py's admit (ARGV[3] = "admit") and charge ("charge") on the key's stored
# theoretical arrival time, with Redis's clock as now. Returns {allowed, retry_after_s as text,
# the budget's debt (theoretical arrival time - now, s) as text}.
# The key expires when the budget is full again (nothing is lost: a missing key is a full bucket).
_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
local cost = tonumber(ARGV[1])
local per_min = tonumber(ARGV[2])
local per_unit = 60 / per_min
local start = math.max(tat, now)
local new
if ARGV[3] == 'charge' then
  new = math.max(start + cost * per_unit, now)
else
  new = start + math.min(cost, per_min) * per_unit
  if new - now > 60 + 1e-9 then
    return {0, string.format('%.6f', new - now - 60), string.format('%.6f', math.max(tat - now, 0))}
  end
end
redis.call('SET', KEYS[1], string.format('%.6f', new), 'PX', math.ceil((new - now) * 1000) + 1000)
return {1, '0', string.format('%.6f', new - now)}
"""


def go_duration(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it (Go's time.Duration format, to the ms):
    "0s", "12ms", "1.5s", "6m0s", "1h0m0s"."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest_ms = divmod(ms, 3_600_000)
    minutes, rest_ms = divmod(rest_ms, 60_000)
    secs = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    return f"{minutes}m{secs}" if minutes else secs


@dataclass(frozen=True)
class Budget:
    """A tenant's budget of one kind as its admission left it: `kind` "requests" or "tokens",
    `limit` a minute, `debt_s` how far its GCRA state is ahead of now (0: full)."""

    kind: str
    limit: int
    debt_s: float

    @property
    def remaining(self) -> int:
        """What may still be spent now: the minute's room the debt leaves."""
        return max(0, math.floor(self.limit * (60.0 - self.debt_s) / 60.0 + 1e-9))

    def headers(self) -> dict[str, str]:
        return {
            f"x-ratelimit-limit-{self.kind}": str(self.limit),
            f"x-ratelimit-remaining-{self.kind}": str(self.remaining),
            f"x-ratelimit-reset-{self.kind}": go_duration(self.debt_s),
        }


def total_tokens_in(chunk: bytes | None) -> int | None:
    """`usage.total_tokens` if this piece of an answer carries it."""
    if chunk is None:
        return None
    match = _TOTAL_TOKENS.search(chunk)
    return int(match.group(1)) if match else None


class RateLimiter:
    def __init__(
        self,
        config: RateLimitsConfig,
        metrics: Metrics,
        *,
        redis: Any | None = None,
        key_prefix: str = "cl:rl",
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._redis = redis
        self._script = redis.register_script(_SCRIPT) if redis is not None else None
        self._prefix = key_prefix
        self._local: dict[tuple[str, str], float] = {}  # (tenant, kind) -> tat_s
        self._redis_down_until = 0.0
        self._pending: set[asyncio.Task[None]] = set()  # corrections sent to Redis

    @property
    def enabled(self) -> bool:
        return bool(self._config.classes or self._config.tenants)

    def limit(self, tenant: Tenant, kind: str) -> int | None:
        """The tenant's limit a minute of `kind` (requests_per_min or tokens_per_min)."""
        for entry in (
            self._config.tenants.get(tenant.name),
            self._config.classes.get(tenant.own_class),
        ):
            value = None if entry is None else getattr(entry, kind)
            if value is not None:
                return int(value)
        return None

    async def admit_request(self, tenant: Tenant) -> Budget | None:
        """Spend one request from the tenant's budget (None: it has no such limit), or raise
        429 carrying the budget's headers."""
        return await self._admit(tenant, "requests_per_min", 1)

    async def admit_tokens(self, tenant: Tenant, tokens: int) -> Budget | None:
        """Spend the prompt's estimated tokens from the tenant's budget (None: it has no such
        limit), or raise 429 carrying the budget's headers."""
        return await self._admit(tenant, "tokens_per_min", tokens)

    def on_usage(
        self, tenant: Tenant, estimated: int, usage: bytes | None, *, sent_tokens: int = 0
    ) -> None:
        """The answer has ended: charge what it used beyond the admitted estimate (or give back
        what it did not use), by its usage, else by the `sent_tokens` of output it sent."""
        per_min = self.limit(tenant, "tokens_per_min")
        total = total_tokens_in(usage)
        if total is None and sent_tokens:
            total = estimated + sent_tokens
        if per_min is None or total is None:
            return
        delta = total - min(estimated, per_min)  # admit charged at most the whole budget
        if delta == 0:
            return
        if self._use_redis():
            task = asyncio.ensure_future(self._redis_charge(tenant, per_min, delta))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
            return
        self._local_charge(tenant, "tokens_per_min", per_min, delta)

    async def close(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    # ---------------------------------------------------------------------------- internals

    async def _admit(self, tenant: Tenant, kind: str, cost: int) -> Budget | None:
        per_min = self.limit(tenant, kind)
        if per_min is None:
            return None
        if self._use_redis():
            try:
                retry_after_s, debt_s = await self._redis_admit(tenant, kind, per_min, cost)
            except Exception as err:
                self._redis_failed(err)
                retry_after_s, debt_s = self._local_admit(tenant, kind, per_min, cost)
        else:
            retry_after_s, debt_s = self._local_admit(tenant, kind, per_min, cost)
        budget = Budget(kind.split("_")[0], per_min, debt_s)
        if retry_after_s is not None:
            raise self._refusal(tenant, budget, retry_after_s)
        return budget

    def _local_admit(
        self, tenant: Tenant, kind: str, per_min: int, cost: int
    ) -> tuple[float | None, float]:
        """(None if admitted, else the seconds to wait; the budget's debt after it)."""
        key = (tenant.name, kind)
        now = time.time()
        tat = self._local.get(key, 0.0)
        verdict = admit(tat, now, cost, per_min)
        if not verdict.allowed:
            return verdict.retry_after_s, max(tat - now, 0.0)
        self._local[key] = verdict.tat_s
        return None, max(verdict.tat_s - now, 0.0)

    def _local_charge(self, tenant: Tenant, kind: str, per_min: int, delta: int) -> None:
        key = (tenant.name, kind)
        self._local[key] = charge(self._local.get(key, 0.0), time.time(), delta, per_min)

    def _key(self, tenant: Tenant, kind: str) -> str:
        return f"{self._prefix}:{kind.split('_')[0]}:{tenant.name}"

    async def _redis_admit(
        self, tenant: Tenant, kind: str, per_min: int, cost: int
    ) -> tuple[float | None, float]:
        assert self._script is not None
        allowed, retry_after, debt = await self._script(
            keys=[self._key(tenant, kind)], args=[cost, per_min, "admit"]
        )
        return (None if int(allowed) else float(retry_after)), float(debt)

    async def _redis_charge(self, tenant: Tenant, per_min: int, delta: int) -> None:
        assert self._script is not None
        try:
            await self._script(
                keys=[self._key(tenant, "tokens_per_min")], args=[delta, per_min, "charge"]
            )
        except Exception as err:
            self._redis_failed(err)
            self._local_charge(tenant, "tokens_per_min", per_min, delta)

    def _use_redis(self) -> bool:
        return self._script is not None and time.monotonic() >= self._redis_down_until

    def _redis_failed(self, err: BaseException) -> None:
        self._redis_down_until = time.monotonic() + REDIS_RETRY_S
        self._metrics.index_errors.labels("rate_limit").inc()
        log.debug("rate limit in Redis failed, using this gateway's own budget: %r", err)

    def _refusal(self, tenant: Tenant, budget: Budget, retry_after_s: float) -> ApiError:
        what = budget.kind
        self._metrics.rate_limited.labels(tenant.name, what).inc()
        wait_s = max(1, math.ceil(retry_after_s))
        return ApiError(
            429,
            f"rate limit reached for {what} per minute (limit {budget.limit}) of tenant "
            f"{tenant.name!r}: retry after {wait_s} s",
            code="rate_limit_exceeded",
            type=what,
            headers={"retry-after": str(wait_s)} | budget.headers(),
        )
