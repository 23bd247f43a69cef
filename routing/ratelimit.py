"""Per-minute rate limits as GCRA (the generic cell rate algorithm, ITU-T I.371; the form the
Redis rate-limiter modules use): one number per limited thing, its theoretical arrival time.

A limit of `per_min` units a minute is a bucket of `per_min` units refilled at per_min / 60 units a
second. Instead of a level and a refill, GCRA keeps `tat_s`: the time at which the bucket would be
full again if nothing more were spent. Spending `cost` units moves it `cost * 60 / per_min` seconds
later. A spend is allowed while the debt stays within one minute's budget:

    start   = max(tat_s, now_s)
    new_tat = start + cost * 60 / per_min
    allowed iff new_tat - now_s <= 60           (the whole budget may be spent at once)
    else retry_after_s = new_tat - now_s - 60    (when this spend would fit)

So N requests at once pass a limit of N a minute, the next is refused for 60 / N seconds, and a
steady N a minute always passes. A cost above the whole budget is charged as the whole budget
(it passes only when the bucket is full), so a large request waits for a full bucket instead of
being refused forever. `charge` applies a correction afterwards (the tokens the engine reported
minus those estimated): it may push `tat_s` further than a minute ahead, which then delays later
requests, or bring it back, never before `now_s`.

The same arithmetic runs in Redis as a Lua script (gateway/tenancy/rate_limits.py) when several
gateways share a budget; tests/unit/test_ratelimit.py holds the table both must satisfy.
"""

from __future__ import annotations

from typing import NamedTuple

WINDOW_S = 60.0  # limits are per minute, as OpenAI's (RPM, TPM)


class Verdict(NamedTuple):
    allowed: bool
    tat_s: float  # the state to keep: unchanged when refused
    retry_after_s: float  # 0 when allowed


def admit(tat_s: float, now_s: float, cost: float, per_min: float) -> Verdict:
    """Spend `cost` units against a limit of `per_min` a minute, if the budget allows."""
    per_unit_s = WINDOW_S / per_min
    start = max(tat_s, now_s)
    new_tat = start + min(cost, per_min) * per_unit_s
    if new_tat - now_s <= WINDOW_S + 1e-9:
        return Verdict(True, new_tat, 0.0)
    return Verdict(False, tat_s, new_tat - now_s - WINDOW_S)


def charge(tat_s: float, now_s: float, delta: float, per_min: float) -> float:
    """`tat_s` after spending `delta` more units (negative: giving some back), unconditionally."""
    return max(max(tat_s, now_s) + delta * WINDOW_S / per_min, now_s)
