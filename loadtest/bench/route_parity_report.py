"""loadtest/bench/route_parity.py's comparison: the decisions two gateways made on one trace,
request by request, and the tables of both phases."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.table import Table

from loadtest.bench import report
from loadtest.bench.replay import Summary
from loadtest.workloads.traces import TraceRecord

DIFFERENCES_SHOWN = 10
CLIENTS = 4
# The concurrent phase's closed-loop clients: one per replica of the fleet, so a replica that
# holds a popular prefix gets a queue and the estimate's queue term takes part in the choice.


@dataclass
class Decision:
    """What the gateway said about one request, in its decision headers."""

    replica: str = ""
    reason: str = ""
    expected_cached_tokens: str = ""
    remote_write: str = ""
    estimate: str = ""  # the estimate's terms (ms) but the measured ones

    def routing(self) -> tuple[str, ...]:
        return (self.replica, self.reason, self.expected_cached_tokens, self.remote_write)

    def terms(self) -> dict[str, float]:
        pairs = (t.split("=") for t in self.estimate.split(",") if "=" in t)
        return {k: float(v) for k, v in pairs}


@dataclass
class Comparison:
    requests: int
    same_replica: int
    same_routing: int  # replica, reason, expected cached tokens, remote write
    same_estimate: int
    first_difference: int | None  # of the routing
    differences: list[dict[str, Any]] = field(default_factory=list)  # the first of the routing
    estimate_deltas_ms: dict[str, list[float]] = field(default_factory=dict)
    # per term, the least and the most after - before, over requests routed alike


def compare(
    trace: Sequence[TraceRecord], before: Sequence[Decision], after: Sequence[Decision]
) -> Comparison:
    pairs = list(zip(before, after, strict=True))
    differing = [i for i, (b, a) in enumerate(pairs) if b.routing() != a.routing()]
    shown = [
        {
            "index": i,
            "request": trace[i].get("conversation") or trace[i]["tenant"],
            "before": asdict(before[i]),
            "after": asdict(after[i]),
        }
        for i in differing[:DIFFERENCES_SHOWN]
    ]
    deltas: dict[str, list[float]] = {}
    for b, a in pairs:
        if b.routing() == a.routing():
            bt, at = b.terms(), a.terms()
            for k in bt.keys() & at.keys():
                deltas.setdefault(k, []).append(round(at[k] - bt[k], 1))
    return Comparison(
        requests=len(trace),
        same_replica=sum(b.replica == a.replica for b, a in pairs),
        same_routing=len(trace) - len(differing),
        same_estimate=sum(b.estimate == a.estimate for b, a in pairs),
        first_difference=differing[0] if differing else None,
        differences=shown,
        estimate_deltas_ms={k: [min(v), max(v)] for k, v in sorted(deltas.items())},
    )


def ratio(after: float, before: float) -> float:
    return after / before if before else float("nan")


def spread(values: Sequence[float]) -> float:
    """max / min over one commit's repeats: how far apart the same code lands."""
    return max(values) / min(values) if values and min(values) > 0 else float("nan")


def sequential_table(
    commits: dict[str, str], summaries: dict[str, Summary], cmp: Comparison
) -> Table:
    table = Table(title="sequential replay: one request at a time, identical routing expected")
    report.add_columns(
        table,
        ("commit", "requests", "ok", "hit rate", "TTFT p50 ms", "TTFT p90 ms"),
        left=("commit",),
    )
    for label, s in summaries.items():
        table.add_row(
            f"{label} {commits[label][:9]}",
            str(s.requests),
            str(s.ok),
            f"{s.hit_rate:.1%}",
            report.ms(s.ttft_p50_ms),
            report.ms(s.ttft_p90_ms),
        )
    deltas = ", ".join(
        f"{k} {lo:+.1f}..{hi:+.1f}" for k, (lo, hi) in cmp.estimate_deltas_ms.items()
    )
    table.caption = (
        f"same replica {cmp.same_replica}/{cmp.requests}; same routing (replica, reason, expected "
        f"cached tokens, remote write) {cmp.same_routing}/{cmp.requests}; same estimate "
        f"{cmp.same_estimate}/{cmp.requests}, after - before in ms where routed alike: {deltas}"
    )
    return table


def differences_table(cmp: Comparison) -> Table:
    table = Table(title=f"first differing routings (of {cmp.requests - cmp.same_routing})")
    report.add_columns(table, ("#", "request", "before", "after"), left=("request",))
    for d in cmp.differences:
        b, a = d["before"], d["after"]
        changed = [k for k in b if b[k] != a[k] and k != "estimate"]
        table.add_row(
            str(d["index"]),
            d["request"],
            " ".join(f"{k}={b[k]}" for k in changed),
            " ".join(f"{k}={a[k]}" for k in changed),
        )
    return table


CONCURRENT_METRICS = {"hit_rate": "hit rate", "ttft_p50_ms": "TTFT p50", "ttft_p90_ms": "TTFT p90"}


def concurrent_ratios(runs: dict[str, list[Summary]]) -> dict[str, dict[str, Any]]:
    """Per metric: after / before of the means; the noise, the larger of the two commits' own
    max / min over their repeats; and whether the ratio is inside it (1/noise..noise)."""
    out: dict[str, dict[str, Any]] = {}
    for key in CONCURRENT_METRICS:
        values = {label: [getattr(s, key) for s in summaries] for label, summaries in runs.items()}
        means = {label: sum(v) / len(v) for label, v in values.items()}
        r = ratio(means["after"], means["before"])
        noise = max(spread(v) for v in values.values())
        out[key] = {"ratio": r, "noise": noise, "within": 1 / noise <= r <= noise}
    return out


def concurrent_table(runs: dict[str, list[Summary]]) -> tuple[Table, dict[str, dict[str, Any]]]:
    table = Table(title=f"concurrent replay: {CLIENTS} clients, defaults (ratios, not identity)")
    report.add_columns(table, ("", *CONCURRENT_METRICS.values()), left=("",))
    for label, summaries in runs.items():
        table.add_row(
            f"{label} ({len(summaries)} runs)",
            " ".join(f"{s.hit_rate:.1%}" for s in summaries),
            " ".join(report.ms(s.ttft_p50_ms) for s in summaries),
            " ".join(report.ms(s.ttft_p90_ms) for s in summaries),
        )
    ratios = concurrent_ratios(runs)
    cells = [ratios[k] for k in CONCURRENT_METRICS]
    table.add_row("after / before (means)", *(f"x{c['ratio']:.3f}" for c in cells))
    table.add_row("noise (max/min of a commit)", *(f"x{c['noise']:.3f}" for c in cells))
    table.add_row("within noise", *("yes" if c["within"] else "NO" for c in cells))
    return table, ratios
