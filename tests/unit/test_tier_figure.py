"""The tier section's figure (loadtest/bench/tier_report.py): one letter per panel, each axis
says what its ticks are."""

from __future__ import annotations

import pytest

from loadtest.bench.replay import RequestResult, summarize
from loadtest.bench.tier_experiment import ArmResult

pytest.importorskip("matplotlib")


def _arm(name: str, ttft_s: float) -> ArmResult:
    results = [
        RequestResult(
            i, "t", "chat", 0.0, status=200, ttft_s=ttft_s, e2e_s=ttft_s, prompt_tokens=100
        )
        for i in range(4)
    ]
    summary = summarize(results, 1.0)
    groups = {"critical": summary, "standard": summary, "all": summary}
    return ArmResult(name, groups, {}, {"sim_remote_written_bytes_total": 1e9})


def test_each_panel_has_its_own_letter_and_labelled_ticks() -> None:
    from loadtest.bench.tier_report import figure

    pinning = {"unpinned": _arm("unpinned", 0.05), "pinned": _arm("pinned", 0.03)}
    reuse = {"high": {"reuse": _arm("reuse", 0.04), "always": _arm("always", 0.05)}}
    fig = figure(pinning, reuse)
    assert fig is not None
    titles = [ax.get_title() for ax in fig.axes]
    assert [t[:3] for t in titles] == ["(a)", "(b)", "(c)"]
    assert all(ax.get_xlabel() for ax in fig.axes[1:])  # the workload names on the ticks
    import matplotlib.pyplot as plt

    plt.close(fig)
