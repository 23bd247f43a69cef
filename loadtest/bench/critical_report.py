"""loadtest/bench/critical.py's output: a table per run (seed x engine), the goal ratios of every
run, and the figure."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from loadtest.bench import figures, report
from loadtest.bench.critical_results import GOALS, SLO_MS, ArmResult, goal_ratios, meets, pooled
from loadtest.bench.report import ms
from loadtest.workloads import critical_traces as ct

GROUPS = ("critical", "standard", "all")


@dataclass
class Run:
    """One seed on one engine: the trace's floor and every arm's result."""

    seed: int
    engine: str
    floor: ct.Floor
    arms: dict[str, ArmResult] = field(default_factory=dict)
    not_run: dict[str, str] = field(default_factory=dict)
    pooled_seeds: tuple[int, ...] = ()  # a pooled run (pooled_runs): the seeds it holds

    @property
    def label(self) -> str:
        if self.pooled_seeds:
            return f"seeds {','.join(map(str, self.pooled_seeds))} pooled, engine {self.engine}"
        return f"seed {self.seed}, engine {self.engine}"

    def ratios(self) -> dict[str, dict[str, float]]:
        return goal_ratios(self.arms)


def pooled_runs(runs: Sequence[Run]) -> list[Run]:
    """Per engine run on several seeds: one run whose every arm holds the requests of all its
    seeds (critical_results.pooled), for ratios steadier than one seed's; an arm that did not
    run on every seed is left out. Its `seed` and `floor` are the first seed's, carried along:
    the pooled run is read for its ratios only (each request keeps its own floor)."""
    out = []
    for engine in dict.fromkeys(r.engine for r in runs):
        mine = [r for r in runs if r.engine == engine]
        if len(mine) < 2:
            continue
        names = list(dict.fromkeys(a for r in mine for a in r.arms))
        arms = {
            a: pooled([r.arms[a] for r in mine]) for a in names if all(a in r.arms for r in mine)
        }
        seeds = tuple(r.seed for r in mine)
        out.append(Run(mine[0].seed, engine, mine[0].floor, arms, pooled_seeds=seeds))
    return out


def run_table(run: Run) -> Table:
    table = Table(
        title=f"{run.label}: TTFT, excess over each request's floor, SLO (ms)",
        box=box.SIMPLE_HEAD,
        caption="excess: TTFT - the request's own floor (its uncached prefill alone, perfect "
        "cache, no queue); floor: of the class; SLO: share within "
        + ", ".join(f"{k} {v:,.0f}" for k, v in SLO_MS.items())
        + " ms (shed and failed count as missed); hit: usage cached / prompt tokens; shed: "
        "503/429 (with Retry-After); failed: other errors and timeouts",
    )
    columns = (
        "arm", "class", "p50", "p90", "p99", "exc p50", "exc p90", "exc p99", "floor p50",
        "floor p99", "SLO", "hit", "shed (R-A)", "failed", "ok/sent",
    )  # fmt: skip
    report.add_columns(table, columns, left=("arm", "class"))
    for name, arm in run.arms.items():
        for i, group in enumerate(GROUPS):
            s = arm.stats(group)
            attained = s["slo_attained"]
            table.add_row(
                name if i == 0 else "",
                group,
                *(ms(s[f"ttft_p{q}_ms"]) for q in (50, 90, 99)),
                *(ms(s[f"excess_p{q}_ms"]) for q in (50, 90, 99)),
                ms(s["floor_p50_ms"]),
                ms(s["floor_p99_ms"]),
                "-" if math.isnan(attained) else f"{attained:.1%}",
                f"{s['hit_rate']:.1%}",
                f"{s['shed']} ({s['shed_with_retry_after']})",
                str(s["failed"]),
                f"{s['ok']}/{s['requests']}",
                end_section=i == len(GROUPS) - 1,
            )
    for name, why in run.not_run.items():
        table.add_row(name, f"[red]not run: {why[:100]}[/]", *[""] * (len(columns) - 2))
    return table


def _cell(goal: str, value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    ok = meets(goal, value)
    text = f"{value:+.3f}" if goal.startswith("hit_rate") else f"{value:.2f}x"
    return text if ok is None else f"{text} {'[green]ok[/]' if ok else '[red]no[/]'}"


def _noise_cell(_goal: str, value: float | None) -> str:
    """The control arm's ratio: the run's noise, not a goal."""
    return "-" if value is None or math.isnan(value) else f"{value:.2f}x (noise)"


def ratios_table(runs: Sequence[Run]) -> Table:
    table = Table(
        title="the goals, per run (within one run: the same fleet, trace and moment)",
        box=box.SIMPLE_HEAD,
        caption="best peer: the lower of sglang-router's and vllm-router's figure (the higher hit "
        "rate); goals: " + "; ".join(f"{k} {op} {v:g}" for k, (op, v) in GOALS.items()),
    )
    columns = (
        "run", "arm", "crit excess p99 / best peer", "all p99 / best peer",
        "hit - best peer", "crit p99 / no-tenants", "all p99 / no-tenants",
    )  # fmt: skip
    report.add_columns(table, columns, left=("run", "arm"))
    for run in runs:
        for i, (arm, r) in enumerate(run.ratios().items()):
            cell = _noise_cell if arm == "control" else _cell
            table.add_row(
                run.label if i == 0 else "",
                arm,
                *(cell(goal, r.get(goal)) for goal in GOALS),
            )
    return table


PLOTTED = (
    ("critical", "excess_p99_ms", "critical excess p99"),
    ("critical", "ttft_p99_ms", "critical TTFT p99"),
    ("all", "ttft_p99_ms", "all TTFT p99"),
)


def medians(runs: Sequence[Run], engine: str) -> dict[str, list[float]]:
    """Per arm, the median over the engine's seeds of each PLOTTED figure."""
    mine = [r for r in runs if r.engine == engine]
    arms = list(dict.fromkeys(a for r in mine for a in r.arms))
    out: dict[str, list[float]] = {}
    for arm in arms:
        values = []
        for group, stat, _ in PLOTTED:
            seen = [r.arms[arm].stats(group)[stat] for r in mine if arm in r.arms]
            seen = [v for v in seen if not math.isnan(v)]
            values.append(statistics.median(seen) if seen else 0.0)
        out[arm] = values
    return out


def plot(path: Path, runs: Sequence[Run], title: str) -> None:
    """Per engine, one panel: per arm, the critical excess p99, critical p99 and overall p99
    (median over seeds)."""
    plt = figures.pyplot()
    engines = list(dict.fromkeys(r.engine for r in runs)) or ["-"]
    fig, axes = plt.subplots(1, len(engines), figsize=(6.5 * len(engines), 4.8), squeeze=False)
    width = 0.27
    colors = ("tab:red", "tab:orange", "tab:blue")
    for ax, engine in zip(axes[0], engines, strict=True):
        per_arm = medians(runs, engine)
        names = list(per_arm)
        for j, (_, _, label) in enumerate(PLOTTED):
            values = [per_arm[n][j] for n in names]
            xs = [i + (j - 1) * width for i in range(len(names))]
            bars = ax.bar(xs, values, width, label=label, color=colors[j])
            ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=6)
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
        ax.set_ylabel("ms (median over seeds)")
        ax.set_title(f"engine: {engine}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    figures.save_figure(fig, path, title=title)


def runs_payload(runs: Sequence[Run], placement: Mapping[str, Any]) -> list[dict[str, Any]]:
    """`placement`: per run label and arm, where its critical requests were served."""
    return [
        {
            "seed": run.seed,
            "engine": run.engine,
            "floor": run.floor.to_dict(),
            "arms": {
                name: arm.to_dict(placement.get(run.label, {}).get(name))
                for name, arm in run.arms.items()
            },
            "goal_ratios": run.ratios(),
            "not_run": run.not_run,
        }
        for run in runs
    ]
