"""Comparison tables (rich) and result files (JSON, PNG via matplotlib's Agg backend)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from loadtest.bench import figures
from loadtest.bench.replay import RequestResult, Summary

BASELINE = "round_robin"
CANDIDATE = "cache_aware"


def ms(value: float | None) -> str:
    """Milliseconds in a table: "-" when there are none (None or NaN)."""
    return "-" if value is None or math.isnan(value) else f"{value:,.0f}"


def ttft_ms(*groups: Summary) -> list[str]:
    """TTFT p50 and p99 of each group, in that order: the cells of a table's row."""
    return [ms(v) for g in groups for v in (g.ttft_p50_ms, g.ttft_p99_ms)]


def add_columns(table: Table, columns: Sequence[str], left: Sequence[str]) -> None:
    """Columns named in `left` (the row's labels) left-aligned, the numbers right-aligned."""
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right")


def comparison_table(summaries: Mapping[str, Summary], ideal_hit_rate: float) -> Table:
    table = Table(
        title="the same trace through each routing policy (latencies in ms)",
        box=box.SIMPLE_HEAD,
        caption="max/mean: busiest replica's requests / mean requests per replica",
    )
    columns = (
        "policy", "hit rate", "ideal", "TTFT p50", "TTFT p99", "e2e p99", "req/s", "errors",
        "max/mean",
    )  # fmt: skip
    add_columns(table, columns, left=("policy",))
    for policy, s in summaries.items():
        table.add_row(
            policy,
            f"{s.hit_rate:.1%}",
            f"{ideal_hit_rate:.1%}",
            *ttft_ms(s),
            ms(s.e2e_p99_ms),
            f"{s.throughput_req_per_s:.1f}",
            str(s.errors),
            f"{s.max_mean_ratio:.2f}",
        )
    return table


def ratios(summaries: Mapping[str, Summary]) -> dict[str, float] | None:
    """cache_aware / round_robin for the headline numbers, when both ran."""
    if BASELINE not in summaries or CANDIDATE not in summaries:
        return None
    base, cand = summaries[BASELINE], summaries[CANDIDATE]

    def ratio(a: float, b: float) -> float:
        return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan

    return {
        "hit_rate": ratio(cand.hit_rate, base.hit_rate),
        "ttft_p50": ratio(cand.ttft_p50_ms, base.ttft_p50_ms),
        "ttft_p99": ratio(cand.ttft_p99_ms, base.ttft_p99_ms),
        "e2e_p99": ratio(cand.e2e_p99_ms, base.e2e_p99_ms),
        "throughput": ratio(cand.throughput_req_per_s, base.throughput_req_per_s),
    }


def print_comparison(
    console: Console, summaries: Mapping[str, Summary], ideal_hit_rate: float
) -> None:
    console.print(comparison_table(summaries, ideal_hit_rate))
    r = ratios(summaries)
    if r is not None:
        console.print(
            f"{CANDIDATE} / {BASELINE}: prefix hit rate x{r['hit_rate']:.2f}, "
            f"TTFT p50 x{r['ttft_p50']:.2f}, TTFT p99 x{r['ttft_p99']:.2f}, "
            f"e2e p99 x{r['e2e_p99']:.2f}"
        )


def clean_floats(value: Any) -> Any:
    """NaN and infinities become None (JSON has neither), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean_floats(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_floats(v) for v in value]
    return value


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean_floats(dict(payload)), indent=2, allow_nan=False) + "\n")


def write_results_jsonl(path: Path, results: Sequence[RequestResult]) -> None:
    """One line per request, for looking at individual requests after the run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in results:
            f.write(json.dumps(clean_floats(asdict(r)), separators=(",", ":")) + "\n")


def plot(
    path: Path,
    results: Mapping[str, Sequence[RequestResult]],
    summaries: Mapping[str, Summary],
    ideal_hit_rate: float,
) -> None:
    """TTFT CDF per policy (log x) and prefix hit rate per policy with the ideal as a line."""
    plt = figures.pyplot()
    fig, (cdf_ax, bar_ax) = plt.subplots(1, 2, figsize=(12, 4.5))

    for policy, rs in results.items():
        ttft_ms = sorted(r.ttft_s * 1000 for r in rs if r.ok and r.ttft_s is not None)
        if ttft_ms:
            fractions = [(i + 1) / len(ttft_ms) for i in range(len(ttft_ms))]
            cdf_ax.step(ttft_ms, fractions, where="post", label=policy)
    cdf_ax.set_xscale("log")
    cdf_ax.set_xlabel("time to first token (ms, log scale)")
    cdf_ax.set_ylabel("fraction of requests")
    cdf_ax.set_title("TTFT CDF")
    cdf_ax.grid(True, which="both", alpha=0.3)
    cdf_ax.legend()

    policies = list(summaries)
    rates = [summaries[p].hit_rate for p in policies]
    bars = bar_ax.bar(policies, rates, color="tab:blue")
    bar_ax.bar_label(bars, labels=[f"{r:.0%}" for r in rates])
    bar_ax.axhline(ideal_hit_rate, color="tab:red", linestyle="--", label="ideal (no router beats)")
    bar_ax.set_ylim(0, 1)
    bar_ax.set_ylabel("prefix cache hit rate (cached / prompt tokens)")
    bar_ax.set_title("Prefix hit rate")
    bar_ax.legend()

    figures.save_figure(fig, path)
