"""What one arm of loadtest/bench/critical.py measured, and the statistics it reports.

Per class (critical, standard, all, and per tenant): TTFT p50/p90/p99; excess p50/p90/p99, a
request's TTFT minus its own floor (critical_traces.ideal_floor: its uncached prefill alone, with
every block any earlier request of the trace reused for free, and no queue); the floor; SLO
attainment against the class's objective (SLO_MS), counted here from the observed TTFT; hit rate;
shed (429/503, and how many with Retry-After); failed. And, across the arms of one run, the
goal ratios (`goal_ratios`, GOALS).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from loadtest.bench.replay import RequestResult, Summary, summarize
from loadtest.workloads import critical_traces as ct
from routing.whatif.summary import percentile

SHED_STATUSES = (429, 503)

SLO_MS: dict[str, float] = {"critical": 500.0, "standard": 1_000.0}
# TTFT objectives per class, counted by the benchmark from the observed TTFT (the gateway's own
# objectives, classes.<class>.ttft_slo_ms, are not assumed). standard: the gateway's standard
# class TTFT budget (gateway/config/classes.py ClassesConfig.standard.ttft_budget_ms, 1 s).
# critical: an assumption, not a measurement: a voice caller hears the model's first token after
# speech recognition and before synthesis, and turn gaps in conversation are ~200 ms on average
# (Stivers et al. 2009, PNAS 106(26)); half a second for the first token leaves the rest of a ~1 s
# reply.

PEER_ARMS = ("sglang", "vllm")
TENANT_ARMS = ("priority", "pinned")
GOALS: dict[str, tuple[str, float]] = {
    "critical_excess_p99_vs_best_peer": ("<=", 0.5),
    "all_ttft_p99_vs_best_peer": ("<=", 0.9),
    "hit_rate_minus_best_peer": (">=", 0.0),
    "critical_ttft_p99_vs_no_tenants": ("<=", 1.0),
    "all_ttft_p99_vs_no_tenants": ("<=", 1.05),
}
# The goals: both tenant arms against the best other router (the lowest of the
# peers' figure, the highest hit rate); the pinned-pool arm against no tenants.


@dataclass(slots=True)
class CriticalResult(RequestResult):
    tenant_class: str = ""
    retry_after: str | None = None  # the Retry-After header of a non-200 answer
    est_ttft_ms: float | None = None  # the gateway's estimate (x-cachelane-est-ttft-ms)
    fallback: str = ""  # x-cachelane-fallback: the critical request left the pinned pool

    @property
    def shed(self) -> bool:
        return self.status in SHED_STATUSES

    @property
    def failed(self) -> bool:
        return not self.ok and not self.shed


def _percentiles(values: Sequence[float], name: str) -> dict[str, float]:
    return {f"{name}_p{q}_ms": percentile(values, q) for q in (50, 90, 99)}


@dataclass
class ArmResult:
    arm: str
    elapsed_s: float
    results: list[CriticalResult]
    pools: dict[str, dict[str, float]]
    floor_ms: list[float | None]  # per request, trace order (critical_traces.Floor.per_request)
    gateway: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] | None = None
    warmup_s: float = 0.0

    @property
    def measured(self) -> list[CriticalResult]:
        """The requests after the warm-up (every table and figure is over these)."""
        return [r for r in self.results if r.scheduled_s >= self.warmup_s]

    def group(self, name: str) -> list[CriticalResult]:
        measured = self.measured
        if name == "all":
            return measured
        if name in ct.CLASSES:
            return [r for r in measured if r.tenant_class == name]
        return [r for r in measured if r.tenant == name]

    def summary(self, name: str) -> Summary:
        return summarize(self.group(name), self.elapsed_s)

    def excess_ms(self, name: str) -> list[float]:
        """TTFT minus the request's own floor, for every successful request of the group."""
        out = []
        for r in self.group(name):
            floor = self.floor_ms[r.index]
            if r.ok and r.ttft_s is not None and floor is not None:
                out.append(r.ttft_s * 1000 - floor)
        return out

    def slo_attained(self, name: str) -> float:
        """Share of the group's requests answered within their class's objective (shed and
        failed ones did not attain it); NaN for `all`'s mix of objectives when a class has none."""
        rs = self.group(name)
        if not rs:
            return math.nan
        met = sum(
            1
            for r in rs
            if r.ok and r.ttft_s is not None and r.ttft_s * 1000 <= SLO_MS[r.tenant_class]
        )
        return met / len(rs)

    def counts(self, name: str) -> dict[str, int]:
        rs = self.group(name)
        shed = [r for r in rs if r.shed]
        return {
            "shed": len(shed),
            "shed_with_retry_after": sum(1 for r in shed if r.retry_after is not None),
            "failed": sum(1 for r in rs if r.failed),
            "timed_out": sum(1 for r in rs if r.error and r.error.startswith("timed out")),
        }

    def stats(self, name: str) -> dict[str, Any]:
        floors = [f for r in self.group(name) if (f := self.floor_ms[r.index]) is not None]
        return {
            **self.summary(name).to_dict(),
            **_percentiles(self.excess_ms(name), "excess"),
            **_percentiles(floors, "floor"),
            "slo_ms": SLO_MS.get(name),
            "slo_attained": self.slo_attained(name),
            **self.counts(name),
        }

    def to_dict(self, placement: Mapping[str, Any] | None) -> dict[str, Any]:
        groups = ("critical", "standard", "all", *ct.TENANTS)
        return {
            "elapsed_s": self.elapsed_s,
            "groups": {g: self.stats(g) for g in groups},
            "critical_placement": placement,
            "pools": self.pools,
            "gateway": self.gateway,
            "warmup_s": self.warmup_s,
            "failure_samples": sorted({r.error or "" for r in self.results if r.failed})[:5],
            "config": self.config,
        }


def pooled(parts: Sequence[ArmResult]) -> ArmResult:
    """One arm's runs over several seeds as one result: every request with its own floor. A
    p99 over one seed's ~250 critical requests rests on its 2-3 slowest; pooled over three
    seeds, on 7-8."""
    results: list[CriticalResult] = []
    floors: list[float | None] = []
    for part in parts:
        results += [replace(r, index=r.index + len(floors)) for r in part.results]
        floors += part.floor_ms
    elapsed_s = sum(p.elapsed_s for p in parts)
    return ArmResult(parts[0].arm, elapsed_s, results, {}, floors, warmup_s=parts[0].warmup_s)


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def goal_ratios(arms: Mapping[str, ArmResult]) -> dict[str, dict[str, float]]:
    """Per tenant arm that ran: the "Done means" ratios against the best peer router that ran
    (NaN when none did) and, for the pinned-pool arm, against no tenants; for the control arm
    (no-tenants again) against no tenants, the run's own noise (no goal: printed as a figure)."""
    peers = [arms[p] for p in PEER_ARMS if p in arms]

    def best(values: list[float], pick: Any = min) -> float:
        values = [v for v in values if not math.isnan(v)]
        return pick(values) if values else math.nan

    def crit_excess_p99(a: ArmResult) -> float:
        return percentile(a.excess_ms("critical"), 99)

    best_excess = best([crit_excess_p99(p) for p in peers])
    best_all = best([p.summary("all").ttft_p99_ms for p in peers])
    best_hit = best([p.summary("all").hit_rate for p in peers], max)
    out: dict[str, dict[str, float]] = {}
    for name in TENANT_ARMS:
        if name not in arms:
            continue
        a = arms[name]
        every = a.summary("all")
        out[name] = {
            "critical_excess_p99_vs_best_peer": _ratio(crit_excess_p99(a), best_excess),
            "all_ttft_p99_vs_best_peer": _ratio(every.ttft_p99_ms, best_all),
            "hit_rate_minus_best_peer": every.hit_rate - best_hit,
        }
        if name == "pinned" and "no-tenants" in arms:
            out[name] |= _against_no_tenants(a, arms["no-tenants"])
    if "control" in arms and "no-tenants" in arms:
        out["control"] = _against_no_tenants(arms["control"], arms["no-tenants"])
    return out


def _against_no_tenants(a: ArmResult, base: ArmResult) -> dict[str, float]:
    return {
        "critical_ttft_p99_vs_no_tenants": _ratio(
            a.summary("critical").ttft_p99_ms, base.summary("critical").ttft_p99_ms
        ),
        "all_ttft_p99_vs_no_tenants": _ratio(
            a.summary("all").ttft_p99_ms, base.summary("all").ttft_p99_ms
        ),
    }


def meets(goal: str, value: float) -> bool | None:
    """Does `value` meet the goal of that name? None when it is not known (NaN)."""
    if math.isnan(value):
        return None
    op, bound = GOALS[goal]
    return value <= bound if op == "<=" else value >= bound
