"""Plain-text tables for the command line's terminal output (`cachelane route-explain`, `report`,
`plan`): each column as wide as its widest cell, numbers right-aligned, a rule under the header.

The serving install draws three tables; a terminal-rendering library for them (rich, with the
pygments it pulls in: ~13 MB of site-packages) would be most of what the plain install carries
beyond serving. The demo and the benchmarks, which draw progress bars and colours, keep rich
through the [sim] extra."""

from __future__ import annotations

import sys
from typing import Protocol, TextIO

GAP = "  "  # between columns


class Printer(Protocol):
    """Where a command prints its lines: `Out` here; a test may pass anything with `print`."""

    def print(self, text: str, /) -> None: ...


class Out:
    """Lines to a stream (stdout unless told)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream

    def print(self, text: str, /) -> None:
        print(text, file=self.stream or sys.stdout)


class TextTable:
    """A title, columns (left- or right-aligned), rows, and sections between groups of rows."""

    def __init__(self, title: str = "") -> None:
        self.title = title
        self._columns: list[str] = []
        self._right: list[bool] = []
        self._rows: list[list[str] | None] = []  # None: a section break

    def add_column(self, name: str, *, right: bool = False) -> None:
        self._columns.append(name)
        self._right.append(right)

    def add_row(self, *cells: str) -> None:
        if len(cells) != len(self._columns):
            raise ValueError(f"{len(cells)} cells for {len(self._columns)} columns")
        self._rows.append(list(cells))

    def add_section(self) -> None:
        if self._rows and self._rows[-1] is not None:
            self._rows.append(None)

    def __str__(self) -> str:
        rows = [r for r in self._rows if r is not None]
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(self._columns)]
        rule = GAP.join("-" * w for w in widths)
        lines = [self.title] if self.title else []
        lines += [self._line(self._columns, widths), rule]
        body = self._rows[:-1] if self._rows and self._rows[-1] is None else self._rows
        lines += [rule if r is None else self._line(r, widths) for r in body]
        return "\n".join(lines)

    def _line(self, cells: list[str], widths: list[int]) -> str:
        padded = (
            c.rjust(w) if right else c.ljust(w)
            for c, w, right in zip(cells, widths, self._right, strict=True)
        )
        return GAP.join(padded).rstrip()
