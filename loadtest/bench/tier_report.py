"""Tables (rich) and plots (matplotlib, Agg) of the tier benchmarks; shared by bench_tiers and the
demo's second section."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from loadtest.bench import figures, report
from loadtest.bench.report import ms
from loadtest.bench.tier_experiment import ArmResult

GB = 1e9
WRITTEN = "cachelane_sim_remote_bytes_written"
FETCHED = "cachelane_sim_remote_fetch_tokens"
SWAPPED = "cachelane_sim_swap_in_tokens"


def _ratio(a: float, b: float) -> float | None:
    if not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def counter(metrics: Mapping[str, float], name: str, **labels: str) -> float:
    key = name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels.items()))
    return metrics.get(key, 0.0)


def fallbacks(arm: ArmResult) -> int:
    return int(
        counter(arm.gateway, "cachelane_critical_fallbacks", action="spill")
        + counter(arm.gateway, "cachelane_critical_fallbacks", action="reject")
    )


def pinning_table(arms: Mapping[str, ArmResult]) -> Table:
    table = Table(
        title="(a) critical voice tenant under a standard burst, same replicas (TTFT in ms)",
        box=box.SIMPLE_HEAD,
        caption="fallbacks: cachelane_critical_fallbacks_total (spill + reject); off-pinned: "
        "critical requests served outside the pinned pool",
    )
    columns = (
        "arm", "critical p50", "critical p99", "standard p50", "standard p99", "standard req/s",
        "standard hit", "errors", "fallbacks", "off-pinned",
    )  # fmt: skip
    report.add_columns(table, columns, left=("arm",))
    for name, arm in arms.items():
        crit, std = arm.groups["critical"], arm.groups["standard"]
        table.add_row(
            name,
            *report.ttft_ms(crit, std),
            f"{std.throughput_req_per_s:.2f}",
            f"{std.hit_rate:.1%}",
            str(crit.errors + std.errors),
            str(fallbacks(arm)),
            str(arm.off_pinned) if name == "pinned" else "-",
        )
    return table


def pinning_ratios(arms: Mapping[str, ArmResult]) -> dict[str, float | None]:
    """pinned / unpinned for the headline numbers, when both ran."""
    if "pinned" not in arms or "unpinned" not in arms:
        return {}
    p, u = arms["pinned"].groups, arms["unpinned"].groups
    return {
        "critical_ttft_p50": _ratio(p["critical"].ttft_p50_ms, u["critical"].ttft_p50_ms),
        "critical_ttft_p99": _ratio(p["critical"].ttft_p99_ms, u["critical"].ttft_p99_ms),
        "standard_ttft_p50": _ratio(p["standard"].ttft_p50_ms, u["standard"].ttft_p50_ms),
        "standard_ttft_p99": _ratio(p["standard"].ttft_p99_ms, u["standard"].ttft_p99_ms),
        "standard_throughput": _ratio(
            p["standard"].throughput_req_per_s, u["standard"].throughput_req_per_s
        ),
    }


def reuse_table(workloads: Mapping[str, Mapping[str, ArmResult]]) -> Table:
    table = Table(
        title="(b) remote-tier admission: remote_write per workload (TTFT in ms)",
        box=box.SIMPLE_HEAD,
        caption="written: sum of the sims' cachelane_sim_remote_bytes_written_total; "
        "admitted/refused: the gateway's cachelane_remote_admission_total; fetched: tokens "
        "loaded from the remote tier",
    )
    for column in (
        "workload", "remote_write", "written GB", "admitted", "refused", "hit rate",
        "fetched k tok", "TTFT p50", "TTFT p90", "TTFT p99", "errors",
    ):  # fmt: skip
        table.add_column(
            column, justify="left" if column in ("workload", "remote_write") else "right"
        )
    for workload, modes in workloads.items():
        for mode, arm in modes.items():
            s = arm.groups["all"]
            table.add_row(
                workload,
                mode,
                f"{arm.sims.get(WRITTEN, 0.0) / GB:.2f}",
                str(int(counter(arm.gateway, "cachelane_remote_admission", verdict="admitted"))),
                str(int(counter(arm.gateway, "cachelane_remote_admission", verdict="refused"))),
                f"{s.hit_rate:.1%}",
                f"{arm.sims.get(FETCHED, 0.0) / 1000:,.0f}",
                ms(s.ttft_p50_ms),
                ms(s.ttft_p90_ms),
                ms(s.ttft_p99_ms),
                str(s.errors),
            )
        table.add_section()
    return table


def reuse_row(arm: ArmResult) -> dict[str, Any]:
    s = arm.groups["all"]
    return {
        "bytes_written": arm.sims.get(WRITTEN, 0.0),
        "hit_rate": s.hit_rate,
        "ttft_p50_ms": s.ttft_p50_ms,
        "ttft_p99_ms": s.ttft_p99_ms,
        "admitted": counter(arm.gateway, "cachelane_remote_admission", verdict="admitted"),
        "refused": counter(arm.gateway, "cachelane_remote_admission", verdict="refused"),
    }


def plot(
    path: Path,
    pinning: Mapping[str, ArmResult],
    reuse: Mapping[str, Mapping[str, ArmResult]],
    title: str = "",
) -> None:
    """The figure of `figure` written to `path` (nothing when there is no arm)."""
    fig = figure(pinning, reuse)
    if fig is not None:
        figures.save_figure(fig, path, title=title)


def figure(
    pinning: Mapping[str, ArmResult], reuse: Mapping[str, Mapping[str, ArmResult]]
) -> Any | None:
    """(a) TTFT p50/p99 per tenant group and arm; (b) GB written to the remote tier and (c) the
    prefix hit rate, per workload and remote_write mode. None: no arm to draw."""
    plt = figures.pyplot()
    panels = (1 if pinning else 0) + (2 if reuse else 0)
    if not panels:
        return None
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.5), squeeze=False)
    ax_iter = iter(axes[0])
    if pinning:
        ax = next(ax_iter)
        labels = [f"{g}\n{q}" for g in ("critical", "standard") for q in ("p50", "p99")]
        width = 0.8 / len(pinning)
        for i, (name, arm) in enumerate(pinning.items()):
            values = [
                getattr(arm.groups[g], f"ttft_{q}_ms")
                for g in ("critical", "standard")
                for q in ("p50", "p99")
            ]
            xs = [x + i * width for x in range(len(labels))]
            bars = ax.bar(xs, values, width, label=name)
            ax.bar_label(bars, labels=[ms(v) for v in values], fontsize=7)
        ax.set_xticks([x + width * (len(pinning) - 1) / 2 for x in range(len(labels))], labels)
        ax.set_ylabel("TTFT (ms)")
        ax.set_title("(a) critical tenant under a standard burst")
        ax.legend()
    if reuse:
        gb_ax, hit_ax = next(ax_iter), next(ax_iter)
        workloads = list(reuse)
        modes = list(dict.fromkeys(m for ms in reuse.values() for m in ms))
        width = 0.8 / max(1, len(modes))
        for i, mode in enumerate(modes):
            xs = [x + i * width for x in range(len(workloads))]
            arms = [reuse[w].get(mode) for w in workloads]
            gb = [a.sims.get(WRITTEN, 0.0) / GB if a else 0.0 for a in arms]
            hit = [a.groups["all"].hit_rate if a else 0.0 for a in arms]
            bars = gb_ax.bar(xs, gb, width, label=mode)
            gb_ax.bar_label(bars, labels=[f"{v:.1f}" for v in gb], fontsize=7)
            bars = hit_ax.bar(xs, hit, width, label=mode)
            hit_ax.bar_label(bars, labels=[f"{v:.0%}" for v in hit], fontsize=7)
        centers = [x + width * (len(modes) - 1) / 2 for x in range(len(workloads))]
        for ax, ylabel, name in (
            (gb_ax, "GB written to the remote tier", "(b) remote-tier admission: bytes written"),
            (hit_ax, "prefix hit rate (cached / prompt tokens)", "(c) remote-tier admission: hits"),
        ):
            ax.set_xticks(centers, workloads)
            ax.set_xlabel("workload (how often its prefixes are reused)")
            ax.set_ylabel(ylabel)
            ax.set_title(name)
            ax.legend(title="remote_write")
        hit_ax.set_ylim(0, 1)
    return fig
