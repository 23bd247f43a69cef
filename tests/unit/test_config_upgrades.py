"""Configs written for an older cachelane, and typos: every key the table lists fails naming
what replaced it, an unknown key gets the closest key, every error of a file is listed at once,
each with its line; YAML errors name the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, GatewayConfig, load_config, parse_config
from gateway.config.upgrades import GONE, Gone, key_path, keys_at

ROOT = Path(__file__).resolve().parents[2]
POOL = {"name": "p", "replicas": ["http://127.0.0.1:1"]}


def _data_with(path: str, value: object = 1) -> dict[str, object]:
    """A valid config with the key at `path` ("pools[].costs.x") set."""
    data: dict[str, object] = {"auth": {"mode": "open"}, "pools": [dict(POOL)]}
    parts = path.replace("[]", "").split(".")
    here: dict[str, object] = data
    for part in parts[:-1]:
        nxt = here.setdefault(part, {})
        if isinstance(nxt, list):
            nxt = nxt[0]
        assert isinstance(nxt, dict)
        here = nxt
    here[parts[-1]] = value
    return data


@pytest.mark.parametrize("gone", GONE, ids=lambda g: g.path)
def test_every_gone_key_fails_naming_what_replaced_it(gone: Gone) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(_data_with(gone.path))
    message = str(err.value)
    assert ("renamed: write " if gone.renamed else "removed: ") + gone.instead in message
    assert "Extra inputs" not in message


@pytest.mark.parametrize("gone", GONE, ids=lambda g: g.path)
def test_the_table_names_keys_that_are_gone_and_keys_that_exist(gone: Gone) -> None:
    parent, _, key = gone.path.rpartition(".")
    loc = [int(p) if p.isdigit() else p for p in parent.replace("[]", ".0").split(".") if p]
    assert key not in keys_at(GatewayConfig, loc), f"{gone.path} is still a key"
    if gone.renamed:
        target = gone.instead.split()[0]
        t_parent, _, t_key = target.rpartition(".")
        t_loc = [int(p) if p.isdigit() else p for p in t_parent.replace("[]", ".0").split(".")]
        assert t_key in keys_at(GatewayConfig, t_loc), f"{target} is not a key"


def test_the_changelog_says_what_went() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    for gone in GONE:
        assert f"`{gone.path}`" in changelog, gone.path


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"pools": [{"name": "p", "replica": ["http://127.0.0.1:1"]}]}, "pools.0.replica: "),
        (_data_with("rate_limit", {}), "rate_limit: unknown key: did you mean 'rate_limits'?"),
        (
            _data_with("pools[].engine.max_num_batched_token", 8),
            "did you mean 'max_num_batched_tokens'",
        ),
        (_data_with("tenant", []), "did you mean 'tenants'?"),
        (_data_with("zzz", 1), "zzz: unknown key (this section takes: admin, auth,"),
    ],
    ids=["pool-replica", "rate_limit", "engine-flag", "tenant", "no-close-key"],
)
def test_an_unknown_key_gets_the_closest_key(data: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        parse_config(data)
    assert expected in str(err.value)
    assert "Extra inputs" not in str(err.value)


def test_every_error_of_a_file_at_once_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(
        "auth: {mode: open}\n"
        "rate_limit: {}\n"
        "pools:\n"
        "  - name: p\n"
        "    replicas: ['http://127.0.0.1:1']\n"
        "    pinned: true\n"
        "    lend_keep_idle: 1\n"
        "    costs: {prefill_chunk_tokens: 512}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"{path} is invalid:")
    assert "rate_limit (line 2): unknown key: did you mean 'rate_limits'?" in message
    assert "pools.0.lend_keep_idle (line 7): removed: delete it" in message
    assert "pools.0.costs.prefill_chunk_tokens (line 8): renamed: write " in message
    assert "pools[].engine.max_num_batched_tokens" in message


def test_a_yaml_error_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("pools:\n  - name: p\n   replicas: []\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert f'in "{path}", line 3' in message
    assert "<unicode string>" not in message


def test_key_path_writes_list_items_as_brackets() -> None:
    assert key_path(("pools", 0, "costs", "x")) == "pools[].costs.x"
    assert key_path(("auth", "api_keys")) == "auth.api_keys"


def test_cachelane_version(capsys: pytest.CaptureFixture[str]) -> None:
    from gateway import __version__
    from gateway.cli.main import main

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"cachelane {__version__}"


def test_the_checks_across_sections_say_every_problem_at_once() -> None:
    data = {
        "auth": {"mode": "open"},
        "tenants": [{"name": "voice", "api_key": "v" * 40}],  # open mode takes no tenant
        "pools": [
            {"name": "p", "replicas": ["http://127.0.0.1:1"]},
            {"name": "p", "replicas": ["http://127.0.0.1:1"]},  # a name and a URL twice
        ],
    }
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    message = str(err.value)
    assert "duplicate pool name" in message
    assert "auth.mode open serves every request" in message
    assert "a replica URL appears twice" in message
