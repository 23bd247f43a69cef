"""The tenant name rule (gateway/tenancy/tenants.py), table-driven, and in config files."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, parse_config
from gateway.tenancy.tenants import MAX_TENANT_NAME_CHARS, name_key, name_problem

KEY = "k" * 32


@pytest.mark.parametrize(
    "name",
    ["acme", "web", "team-a_b.c", "A1", "0day", "café", "Ünïcödé", "日本語", "x" * 64],
    ids=["plain", "short", "punctuation", "upper", "digit-first", "nfc", "accents", "cjk", "64"],
)
def test_valid_names(name: str) -> None:
    assert name_problem(name) is None


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("", "1 to 64"),
        ("x" * (MAX_TENANT_NAME_CHARS + 1), "1 to 64"),
        ("ac\x00me", "'\\x00'"),
        ("acme\n", "'\\n'"),
        ("ac\tme", "'\\t'"),
        ("acme\u202e", "'\\u202e'"),  # right-to-left override
        ("ac\u200bme", "'\\u200b'"),  # zero-width space
        ("ac\u200dme", "'\\u200d'"),  # zero-width joiner
        ("ac me", "' '"),
        ('ac"me', "'\"'"),
        ("ac=me", "'='"),
        ("a/b", "'/'"),
        (".hidden", "start with a letter or a digit"),
        ("-flag", "start with a letter or a digit"),
        ("cafe\u0301", "NFC"),
    ],
    ids=[
        "empty", "65", "nul", "newline", "tab", "rlo", "zwsp", "zwj", "space", "quote",
        "equals", "slash", "dot-first", "dash-first", "nfd",
    ],
)  # fmt: skip
def test_invalid_names(name: str, problem: str) -> None:
    found = name_problem(name)
    assert found is not None and problem in found, found


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("acme", "ACME"),
        ("acme", "Acme"),
        ("acme", "\uff41\uff43\uff4d\uff45"),
        ("straße", "STRASSE"),
    ],
    ids=["upper", "title", "fullwidth", "sharp-s"],
)
def test_folded_names_collide(a: str, b: str) -> None:
    assert name_key(a) == name_key(b)


def config_with(*names: str) -> dict[str, object]:
    return {
        "pools": [{"name": "p", "models": ["m"], "replicas": ["http://127.0.0.1:1"]}],
        "tenants": [{"name": n, "api_key": f"{KEY}{i}"} for i, n in enumerate(names)],
    }


def test_a_config_with_a_bad_tenant_name_names_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(config_with("web", "evil\u202etxt"))
    assert "tenants.1.name" in str(err.value)
    assert "'\\u202e'" in str(err.value)
    assert "\u202e" not in str(err.value)  # the message itself is safe to print


def test_a_config_with_two_names_equal_when_folded_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(config_with("acme", "web", "ACME"))
    assert "tenants.2.name" in str(err.value)
    assert "tenants.0.name" in str(err.value)
