"""What one arm of loadtest/bench/family.py measured, and the ratios the family is judged by:
each cachelane arm against the better peer per member, the median and the worst decile over the
family, and the goals."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtest.bench.family_members import Member
from loadtest.bench.replay import RequestResult
from routing.whatif.summary import percentile

CACHELANE_ARMS = ("quickstart", "told")
PEER_ARMS = ("vllm", "sglang")

EST_MIN_TTFT_S = 0.05
EST_SKIP_FIRST = 50
# The estimate's error, as the estimate benchmark counts it (docs/bench/estimate.md): TTFTs of at
# least 50 ms (below, a few ms of the shared cores' jitter is a large share), after the first 50
# requests (a fresh gateway learns the fleet from them).

GOALS = {
    "quickstart": {
        "every member": {
            "ttft_p90": ("<=", 1.0),
            "ttft_p99": ("<=", 1.0),
            "excess_p99": ("<=", 1.0),
            "hit_points": (">=", -0.5),
        }
    },
    "told": {
        "median": {"excess_p90": ("<=", 0.7), "excess_p99": ("<=", 0.7)},
        "worst decile": {"excess_p90": ("<=", 1.0), "excess_p99": ("<=", 1.0)},
    },
}
# What the family is held to: the quick start never worse than the better peer (TTFT and excess
# as ratios, hit rate in points); told the fleet, a clear gain on the median member.


@dataclass(slots=True)
class FamilyResult(RequestResult):
    est_ttft_ms: float | None = None  # cachelane's x-cachelane-est-ttft-ms


@dataclass
class ArmStats:
    arm: str
    requests: int
    failed: int
    hit: float
    hit_over_ideal: float
    ttft_ms: dict[str, float]  # p50, p90, p99
    excess_ms: dict[str, float]  # p50, p90, p99
    max_over_mean: float  # the busiest replica's prompt tokens over the mean
    est_error_p50: float | None
    est_error_p90: float | None
    elapsed_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _pcts(values: Sequence[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


def arm_stats(
    arm: str,
    member: Member,
    results: Sequence[FamilyResult],
    per_replica: Sequence[float],
    elapsed_s: float,
) -> ArmStats:
    ok = [r for r in results if r.ok and r.ttft_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    hit = sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0
    floor = member.floor.per_request
    excess = [
        r.ttft_s * 1000 - f  # type: ignore[operator]
        for r in ok
        if (f := floor[r.index]) is not None
    ]
    errors = [
        abs(r.est_ttft_ms / 1000 - r.ttft_s) / r.ttft_s  # type: ignore[operator]
        for r in ok
        if r.est_ttft_ms is not None and r.index >= EST_SKIP_FIRST and r.ttft_s >= EST_MIN_TTFT_S  # type: ignore[operator]
    ]
    mean = sum(per_replica) / len(per_replica) if per_replica else 0.0
    return ArmStats(
        arm=arm,
        requests=len(results),
        failed=len(results) - len(ok),
        hit=hit,
        hit_over_ideal=hit / member.ideal_hit if member.ideal_hit else float("nan"),
        ttft_ms=_pcts([r.ttft_s * 1000 for r in ok]),  # type: ignore[operator]
        excess_ms=_pcts(excess),
        max_over_mean=max(per_replica) / mean if mean else float("nan"),
        est_error_p50=percentile(errors, 50) if errors else None,
        est_error_p90=percentile(errors, 90) if errors else None,
        elapsed_s=elapsed_s,
    )


RATIO_KEYS = ("ttft_p50", "ttft_p90", "ttft_p99", "excess_p90", "excess_p99")


def _metric(stats: ArmStats, key: str) -> float:
    kind, q = key.split("_")
    return (stats.ttft_ms if kind == "ttft" else stats.excess_ms)[q]


def ratios_to_peers(arms: Mapping[str, ArmStats]) -> dict[str, dict[str, float]]:
    """Each cachelane arm against the better peer: TTFT and excess as ratios to the lower peer
    figure (excess below 1 ms counts as 1 ms: the floor's own rounding), hit in points above
    the higher peer."""
    peers = [arms[p] for p in PEER_ARMS if p in arms]
    if not peers:
        return {}
    out: dict[str, dict[str, float]] = {}
    for arm in CACHELANE_ARMS:
        if arm not in arms:
            continue
        mine = arms[arm]
        row = {}
        for key in RATIO_KEYS:
            best = min(_metric(p, key) for p in peers)
            row[key] = max(_metric(mine, key), 1.0) / max(best, 1.0)
        row["hit_points"] = 100 * (mine.hit - max(p.hit for p in peers))
        out[arm] = row
    return out


def family_summary(per_member: Sequence[Mapping[str, Mapping[str, float]]]) -> dict[str, Any]:
    """Per cachelane arm and ratio: the median member and the worst decile (the 90th percentile
    of a ratio, the 10th of the hit points), and the worst member."""
    out: dict[str, Any] = {}
    for arm in CACHELANE_ARMS:
        rows = [m[arm] for m in per_member if arm in m]
        if not rows:
            continue
        arm_out = {}
        for key in (*RATIO_KEYS, "hit_points"):
            values = [r[key] for r in rows]
            worse_high = key != "hit_points"
            arm_out[key] = {
                "median": percentile(values, 50),
                "worst_decile": percentile(values, 90 if worse_high else 10),
                "worst": max(values) if worse_high else min(values),
            }
        out[arm] = arm_out
    return out


def goal_verdicts(
    per_member: Sequence[Mapping[str, Mapping[str, float]]], summary: Mapping[str, Any]
) -> list[tuple[str, str, float, str, float, bool]]:
    """(arm, scope:key, value, op, goal, met) for every goal in GOALS."""
    out = []
    for arm, scopes in GOALS.items():
        if arm not in summary:
            continue
        for scope, goals in scopes.items():
            for key, (op, goal) in goals.items():
                stat = {"every member": "worst", "median": "median", "worst decile": "worst_decile"}
                value = summary[arm][key][stat[scope]]
                met = value <= goal if op == "<=" else value >= goal
                out.append((arm, f"{scope}: {key}", value, op, goal, met))
    return out
