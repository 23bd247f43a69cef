"""`cachelane plan`'s edge: reading a capture file (one being written included) and its args."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli.plan import _targets, read_capture
from routing.whatif.capture import CaptureError
from tests.unit.test_whatif import _header_obj, _request_obj


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(lines))
    return path


def test_a_last_line_cut_short_is_skipped(tmp_path: Path) -> None:
    """A live capture: the writer may have flushed half a line."""
    whole = [json.dumps(o) + "\n" for o in (_header_obj(), _request_obj(1.0, [1, 2]))]
    partial = json.dumps(_request_obj(2.0, [3]))[:40]
    capture = read_capture(_write(tmp_path / "c.jsonl", [*whole, partial]))
    assert len(capture.requests) == 1


def test_a_broken_line_inside_is_an_error(tmp_path: Path) -> None:
    lines = [
        json.dumps(_header_obj()) + "\n",
        "{not json\n",
        json.dumps(_request_obj(1.0, [1])) + "\n",
    ]
    with pytest.raises(CaptureError, match="line 2"):
        read_capture(_write(tmp_path / "c.jsonl", lines))


def test_targets_default_to_the_class_budgets_and_take_overrides() -> None:
    assert _targets([]) == {"standard": 1000.0, "batch": 500.0}
    assert _targets(["critical=150", "standard=800"]) == {
        "standard": 800.0,
        "batch": 500.0,
        "critical": 150.0,
    }
    with pytest.raises(ValueError):
        _targets(["critical"])
