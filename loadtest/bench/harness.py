"""What every benchmark's command does around its arms: the flags it shares, the console, the log
folder beside the results, the run that Ctrl-C or SIGTERM stops cleanly, the JSON and the figure.

A benchmark brings its arms, its table and its plot; this module brings the rest, so that two
benchmarks stop, report and write the same way.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx
from rich.console import Console

from loadtest.bench import report
from loadtest.bench.peer_routers import ensure_installed
from loadtest.bench.processes import sigterm_as_interrupt

T = TypeVar("T")

ARM_ERRORS = (RuntimeError, OSError, httpx.HTTPError)
# what one arm may fail with (a process that did not start or answer) without ending the run

INTERRUPTED = 130  # the shell's code for a process ended by Ctrl-C (128 + SIGINT)
FAILED = 1


def parser(name: str, description: str, quick: str | None = None) -> argparse.ArgumentParser:
    """`python -m loadtest.bench.<name>`'s parser; with `quick` (its help), the --quick flag
    that runs a benchmark short, to check the machinery rather than to measure."""
    p = argparse.ArgumentParser(prog=f"python -m loadtest.bench.{name}", description=description)
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    return p


def add_names(parser: argparse.ArgumentParser, flag: str, names: Iterable[str], what: str) -> None:
    """A comma-separated list flag (arms, modes, shapes) whose default is all of `names`."""
    parser.add_argument(
        flag, default=",".join(names), help=f"{what} (default: %(default)s)".lstrip()
    )


def add_seed_and_out(parser: argparse.ArgumentParser, out: Path, seed: int = 1) -> None:
    """The flags every benchmark ends with: the trace seed and the results' JSON path."""
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--out", type=Path, default=out, help="(default: %(default)s)")


def console(width: int) -> Console:
    """A terminal's own width; when piped or captured there is none to detect, so `width`
    keeps the tables from wrapping at 80 columns."""
    return Console() if sys.stdout.isatty() else Console(width=width)


def log_dir(out: Path) -> Path:
    """The folder beside the results' JSON (results/x.json -> results/x/) for logs and
    per-request files; created."""
    path = out.parent / out.stem
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_arms(
    out: Console,
    name: str,
    arms: Callable[[], None],
    errors: tuple[type[Exception], ...] = (RuntimeError,),
) -> int:
    """Run `arms` with SIGTERM unwinding like Ctrl-C (so every child process is stopped);
    0 when they ran, INTERRUPTED when stopped, FAILED (the error printed) on `errors`."""
    try:
        with sigterm_as_interrupt():
            arms()
    except KeyboardInterrupt:
        out.print("[yellow]interrupted; every process was stopped")
        return INTERRUPTED
    except errors as err:
        out.print(f"[red]{name}: {err}")
        return FAILED
    return 0


def try_arm(
    out: Console,
    label: str,
    not_run: dict[str, str],
    arm: Callable[[], T],
    indent: str = "",
) -> T | None:
    """One arm's result, or None when it failed: why (its error's first line) goes in
    `not_run`, the error is printed, and the other arms go on."""
    try:
        return arm()
    except ARM_ERRORS as err:
        not_run[label] = str(err).splitlines()[0]
        out.print(f"{indent}[red]{label}: {err}")
        return None


def print_not_run(out: Console, not_run: Mapping[str, str]) -> None:
    """After the tables: each arm that did not run, and why (try_arm's `not_run`)."""
    for label, why in not_run.items():
        out.print(f"[red]{label} not run: {why}")


def peer_router_error(out: Console, kind: str) -> str | None:
    """Why the external `kind`-router cannot run (printed), or None once it is installed."""
    out.print(f"checking {kind}-router in .venv-routers/ (pip install on first use) ...")
    error = ensure_installed(kind)
    if error:
        out.print(f"[red]{kind}-router unavailable: {error}")
    return error


def write_results(
    out: Console,
    json_path: Path,
    payload: Mapping[str, Any],
    draw: Callable[[Path], None],
    wall_s: float,
    logs: Path,
) -> None:
    """The results' JSON, the figure beside it (same name, .png), and the line saying where."""
    report.write_json(json_path, payload)
    png = json_path.with_suffix(".png")
    draw(png)
    out.print(f"wrote {json_path} and {png} in {wall_s:.0f} s; logs in {logs}/")
