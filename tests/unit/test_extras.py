"""The install hint names what installed this cachelane (PEP 610's direct_url.json)."""

from __future__ import annotations

import pytest

from gateway.extras import CHECKOUT, _hint_from_record, install_hint


@pytest.mark.parametrize(
    ("record", "hint"),
    [
        (
            {"url": "file:///src/cachelane", "dir_info": {"editable": True}},
            "pip install -e '/src/cachelane[sim]'",
        ),
        ({"url": "file:///src/cachelane", "dir_info": {}}, "pip install '/src/cachelane[sim]'"),
        (
            {"url": "file:///tmp/w/cachelane-0.1.0-py3-none-any.whl", "archive_info": {}},
            "pip install '/tmp/w/cachelane-0.1.0-py3-none-any.whl[sim]'",
        ),
        (
            {"url": "file:///tmp/my%20dir/cachelane", "dir_info": {}},
            "pip install '/tmp/my dir/cachelane[sim]'",
        ),
        (
            {"url": "https://example.org/cachelane.tar.gz", "archive_info": {}},
            "pip install 'cachelane[sim] @ https://example.org/cachelane.tar.gz'",
        ),
        (
            {"url": "https://git.example.org/cachelane", "vcs_info": {"vcs": "git"}},
            "pip install 'cachelane[sim] @ git+https://git.example.org/cachelane'",
        ),
    ],
    ids=["editable-checkout", "checkout", "wheel", "quoted-path", "archive-url", "git"],
)
def test_the_hint_follows_the_install_record(record: dict[str, object], hint: str) -> None:
    assert _hint_from_record(record, "sim") == hint


def test_the_hint_from_this_checkout_names_a_path_not_an_unpublished_name() -> None:
    hint = install_hint("sim")
    assert hint.endswith("[sim]'") and "/" in hint  # a checkout's path (or the wheel's)
    assert (CHECKOUT / "pyproject.toml").is_file()
