"""Ejection by the outcome of real requests: how long a replica stays out, and the probe that
lets it back in.

A replica is ejected when its own traffic fails (health.eject_after_errors 5xx answers,
first-byte timeouts or broken connections in a row, or one refused connection), whatever its
health check says: a replica can list its models and still fail every generation. What a request
asks can make a healthy replica fail it too (a prompt its engine chokes on, an output past any
deadline), so a run of errors ejects only when it holds the requests of MIN_TENANTS_TO_EJECT
tenants; one tenant's alone make the replica a suspect, and the health checker's probe generation
(a request of the gateway's own) decides (ErrorRun). It stays out for a back-off that
grows with each ejection in a row (health.ejection_s x health.ejection_factor ^ (n - 1), at most
health.max_ejection_s), then is half open: the health checker sends it one real generation
(max_tokens 1, gateway/fleet/health_checks.py `probe_generation`); only when that succeeds does
full traffic return. A failed probe starts the next, longer, back-off. A replica that then stays
in for as long as it was last out is forgiven: its next ejection starts from the base again
(Envoy's outlier detection lowers its ejection multiplier the same way while a host stays
healthy).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

# Errors in a row eject a replica at once when this many tenants' requests failed on it: the
# fewest that one tenant cannot make up alone
MIN_TENANTS_TO_EJECT = 2


@dataclass
class ErrorRun:
    """A replica's passive errors in a row, and whose requests they were; `suspect`: (reason,
    error) once they were enough to eject it but all of one tenant's, until a probe decides."""

    count: int = 0
    tenants: set[str] = field(default_factory=set)
    suspect: tuple[str, str] | None = None

    def add(self, tenant: str, reason: str, error: str, limit: int) -> bool:
        """Count an error of `tenant`'s request; True when the run ejects the replica now (at
        `limit` errors, 0: never, of MIN_TENANTS_TO_EJECT tenants' requests), else at the limit
        it makes the replica a suspect."""
        self.count += 1
        self.tenants.add(tenant)
        if not limit or self.count < limit:
            return False
        if len(self.tenants) >= MIN_TENANTS_TO_EJECT:
            return True
        self.suspect = (reason, error)
        return False

    def forgive(self) -> None:
        """An answer, a passed probe or a re-admission: the run is over."""
        self.count = 0
        self.tenants.clear()
        self.suspect = None


@dataclass
class Ejection:
    """A replica out of routing for how its requests went, and when it is probed next."""

    reason: str  # 5xx, timeout, connect (the metrics label)
    error: str  # the last failure, as /ready shows it
    since_s: float  # time.monotonic() of the first ejection of this run
    probe_at_s: float  # time.monotonic() from which the health checker probes it
    count: int  # ejections in a row (a failed probe counts one more)

    def view(self, now_s: float) -> dict[str, Any]:
        """What /ready shows of it."""
        return {
            "reason": self.reason,
            "error": self.error,
            "ejections_in_a_row": self.count,
            "out_for_s": round(now_s - self.since_s, 3),
            "next_probe_in_s": round(max(0.0, self.probe_at_s - now_s), 3),
        }


@dataclass(frozen=True)
class Backoff:
    base_s: float
    factor: float
    max_s: float

    def seconds(self, count: int) -> float:
        """The time out after the `count`-th ejection in a row (1: the base)."""
        if self.base_s <= 0:
            return 0.0
        exponent = max(0, count - 1)
        # past the cap the power only grows: stop before it overflows a float
        if self.factor > 1 and self.base_s * self.factor ** min(exponent, 64) >= self.max_s:
            return self.max_s
        return float(min(self.base_s * self.factor**exponent, self.max_s))

    def eject(
        self, previous: Ejection | None, reason: str, error: str, *, stayed_s: float
    ) -> Ejection:
        """The ejection that starts now: the next in a row, unless the replica stayed in for as
        long as it was last out (`stayed_s`: since it was last admitted)."""
        now = time.monotonic()
        count = (
            1
            if previous is None or stayed_s >= self.seconds(previous.count)
            else previous.count + 1
        )
        since = now if count == 1 or previous is None else previous.since_s
        return Ejection(reason, error, since, now + self.seconds(count), count)

    def probe_failed(self, ejection: Ejection, error: str) -> None:
        """A failed probe: out again, for the next back-off."""
        ejection.count += 1
        ejection.error = error
        ejection.probe_at_s = time.monotonic() + self.seconds(ejection.count)
