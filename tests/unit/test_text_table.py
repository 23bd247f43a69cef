"""The command line's plain-text tables (gateway/cli/text_table.py): aligned columns, sections."""

import pytest

from gateway.cli.text_table import TextTable


def test_columns_are_as_wide_as_their_widest_cell_and_numbers_align_right() -> None:
    table = TextTable("title")
    table.add_column("replica")
    table.add_column("TTFT", right=True)
    table.add_row("a", "1.25")
    table.add_section()
    table.add_row("replica-long", "10.50")
    table.add_section()  # a trailing section draws nothing
    assert str(table).splitlines() == [
        "title",
        "replica        TTFT",
        "------------  -----",
        "a              1.25",
        "------------  -----",
        "replica-long  10.50",
    ]


def test_a_row_must_fill_every_column() -> None:
    table = TextTable()
    table.add_column("a")
    with pytest.raises(ValueError, match="2 cells for 1 columns"):
        table.add_row("x", "y")
