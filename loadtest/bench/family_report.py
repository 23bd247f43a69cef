"""The family benchmark's output: a table per member, the family's summary, the plot and the
markdown tables docs/bench/family.md shows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from loadtest.bench import figures
from loadtest.bench.family_members import Member
from loadtest.bench.family_stats import CACHELANE_ARMS, RATIO_KEYS, ArmStats
from loadtest.bench.report import ms


def member_table(member: Member, arms: Mapping[str, ArmStats]) -> Table:
    f = member.fleet
    title = (
        f"{member.name}: {len(member.trace)} requests at {member.rate_per_s:.1f}/s, load "
        f"{member.load:.2f}, ideal hit {member.ideal_hit:.3f}; {f.replicas} x "
        f"{f.prefill_tokens_per_s:,.0f} tok/s, {f.tiers}, budget {f.max_num_batched_tokens}"
        f"{f' threshold {f.long_prefill_token_threshold}' * bool(f.long_prefill_token_threshold)}"
        f", {f.scheduling_policy}, decode {f.decode_step_s * 1000:.0f} ms"
    )
    table = Table(title=title, title_justify="left")
    cols = ("arm", "hit", "hit/ideal", "TTFT p50", "p90", "p99", "excess p90", "p99")
    for c in (*cols, "max/mean", "est err p90", "failed"):
        table.add_column(c, justify="left" if c == "arm" else "right")
    for arm, s in arms.items():
        est = "" if s.est_error_p90 is None else f"{s.est_error_p90:.2f}"
        table.add_row(
            arm,
            f"{s.hit:.3f}",
            f"{s.hit_over_ideal:.2f}",
            ms(s.ttft_ms["p50"]),
            ms(s.ttft_ms["p90"]),
            ms(s.ttft_ms["p99"]),
            ms(s.excess_ms["p90"]),
            ms(s.excess_ms["p99"]),
            f"{s.max_over_mean:.2f}",
            est,
            str(s.failed),
        )
    return table


def summary_table(summary: Mapping[str, Any], members: int) -> Table:
    table = Table(
        title=f"cachelane / better peer over {members} members: median, worst decile, worst",
        title_justify="left",
    )
    table.add_column("arm")
    for key in (*RATIO_KEYS, "hit_points"):
        table.add_column(key.replace("_", " "), justify="right")
    for arm, row in summary.items():
        cells = []
        for key in (*RATIO_KEYS, "hit_points"):
            v = row[key]
            fmt = "{:+.1f}" if key == "hit_points" else "{:.2f}x"
            cells.append(" / ".join(fmt.format(v[s]) for s in ("median", "worst_decile", "worst")))
        table.add_row(arm, *cells)
    return table


def draw(path: Path, names: Sequence[str], per_member: Sequence[Mapping[str, Any]]) -> None:
    """Per member, each cachelane arm's excess p99 and TTFT p99 over the better peer's."""
    plt = figures.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), sharey=False)
    width = 0.38
    xs = range(len(names))
    for ax, key, label in (
        (axes[0], "excess_p99", "excess p99 / better peer"),
        (axes[1], "ttft_p99", "TTFT p99 / better peer"),
        (axes[2], "hit_points", "hit rate - better peer (points)"),
    ):
        for j, arm in enumerate(CACHELANE_ARMS):
            vals = [m.get(arm, {}).get(key, float("nan")) for m in per_member]
            ax.bar([x + (j - 0.5) * width for x in xs], vals, width, label=arm)
        ax.axhline(0.0 if key == "hit_points" else 1.0, color="black", lw=1)
        if key != "hit_points":
            ax.set_yscale("log")
        ax.set_title(label)
        ax.set_xticks(list(xs), names, rotation=60, ha="right", fontsize=8)
    axes[0].legend()
    figures.save_figure(
        fig, path, title="cachelane against the better of vllm-router and sglang-router"
    )


def markdown(payload: Mapping[str, Any]) -> str:
    """The run as the tables docs/bench/family.md shows: per member and arm, then the family."""
    lines = [
        "| member | fleet | arm | hit (ideal) | TTFT p50 / p90 / p99 | excess p90 / p99 "
        "| est. miss p90 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in payload["members"]:
        f = m["fleet"]
        tiers = "+".join(["hbm"] + ["cpu"] * bool(f["cpu_tokens"]) + ["remote"] * f["remote"])
        threshold = f["long_prefill_token_threshold"]
        fleet = (
            f"{f['replicas']} x {f['prefill_tokens_per_s']:,.0f} tok/s, {tiers}, budget "
            f"{f['max_num_batched_tokens']}{f' thr {threshold}' * bool(threshold)}, "
            f"{f['scheduling_policy']}, decode {f['decode_step_s'] * 1000:.0f} ms, "
            f"load {m['load']:.2f}"
        )
        for i, (arm, a) in enumerate(m["arms"].items()):
            t, e = a["ttft_ms"], a["excess_ms"]
            est = "" if a["est_error_p90"] is None else f"{a['est_error_p90']:.2f}"
            lines.append(
                f"| {m['name'] if i == 0 else ''} | {fleet if i == 0 else ''} | {arm} | "
                f"{a['hit']:.3f} ({m['ideal_hit']:.3f}) | {t['p50']:,.0f} / {t['p90']:,.0f} / "
                f"{t['p99']:,.0f} | {e['p90']:,.0f} / {e['p99']:,.0f} | {est} |"
            )
    lines += [
        "",
        "| arm | ratio to the better peer | median | worst decile | worst |",
        "| --- | --- | --- | --- | --- |",
    ]
    for arm, row in payload["summary"].items():
        for key, v in row.items():
            fmt = "{:+.1f}" if key == "hit_points" else "{:.2f}x"
            cells = " | ".join(fmt.format(v[s]) for s in ("median", "worst_decile", "worst"))
            lines.append(f"| {arm} | {key.replace('_', ' ')} | {cells} |")
    return "\n".join(lines) + "\n"
