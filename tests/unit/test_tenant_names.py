"""The tenant name rule (gateway/tenancy/tenants.py), table-driven, and in config files."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, parse_config
from gateway.tenancy.tenants import MAX_TENANT_NAME_CHARS, name_problem

KEY = "k" * 32


@pytest.mark.parametrize(
    "name",
    ["acme", "web", "team-a_b.c", "0day", "x" * 64],
    ids=["plain", "short", "punctuation", "digit-first", "64"],
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
        ("ac me", "' '"),
        ('ac"me', "'\"'"),
        ("a/b", "'/'"),
        (".hidden", "start with a letter or a digit"),
        ("-flag", "start with a letter or a digit"),
        ("Acme", "'A'"),
        ("caf\u00e9", "'\\xe9'"),
        ("\u0430cme", "'\\u0430'"),  # Cyrillic a
        ("acme\u034f", "'\\u034f'"),  # combining grapheme joiner
        ("acme\ufe0f", "'\\ufe0f'"),  # variation selector
        ("acme\u180b", "'\\u180b'"),  # Mongolian free variation selector
        ("acme\u3164", "'\\u3164'"),  # Hangul filler
        ("\u115facme", "'\\u115f'"),  # Hangul choseong filler
        ("a\u0336cme", "'\\u0336'"),  # combining long stroke overlay
        ("\u3164", "'\\u3164'"),  # invisible alone
        ("\uff41cme", "'\\uff41'"),  # full-width a
    ],
    ids=[
        "empty", "65", "nul", "newline", "tab", "rlo", "zwsp", "space", "quote", "slash",
        "dot-first", "dash-first", "upper", "accent", "cyrillic", "cgj", "vs16", "fvs1",
        "hangul-filler", "choseong-filler", "overlay", "invisible", "fullwidth",
    ],
)  # fmt: skip
def test_invalid_names(name: str, problem: str) -> None:
    found = name_problem(name)
    assert found is not None and problem in found, found


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


def test_a_config_with_one_name_twice_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(config_with("acme", "web", "acme"))
    assert "tenants.2.name" in str(err.value)
    assert "tenants.0.name" in str(err.value)


@pytest.mark.parametrize("group", ["a\nb", "a\x00b", "g" * 5000, "Team"], ids=str)
def test_a_config_with_a_bad_share_group_names_the_key(group: str) -> None:
    data = config_with("web")
    data["tenants"][0]["share_group"] = group  # type: ignore[index]
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert "tenants.0.share_group" in str(err.value)
