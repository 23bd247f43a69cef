"""The benchmarks' figures: pyplot drawing to files; one way to lay out, write and close them."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any


def pyplot() -> ModuleType:
    """matplotlib's pyplot drawing to files only; imported on first use so that `cachelane
    serve` never loads matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display: must precede pyplot's import
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, *, title: str = "", dpi: int = 110) -> None:
    """Lay out, title (when given), write and close a figure."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, wrap=True)  # a long title wraps to the figure's width, not clipped
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
