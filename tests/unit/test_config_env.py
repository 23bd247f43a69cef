"""Config from the environment: ${VAR}, ${VAR:-default}, *_file secrets, check-config."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli.main import main
from gateway.config import ConfigError, load_config

CONFIG = """\
listen: {host: "${HOST:-127.0.0.1}", port: "${PORT}"}
index: {backend: redis, redis_url_file: "${SECRETS}/redis-url"}
pools:
  - name: p
    replicas: ["http://${REPLICA_HOST}:8001"]
tenants:
  - {name: voice, class: critical, api_key_file: "${SECRETS}/voice-key"}
admin: {api_key: "${ADMIN_KEY:-}$${literal}-0123456789abcdef0123456789"}
auth: {secret_file: "${SECRETS}/auth-secret"}
"""


@pytest.fixture
def secrets(tmp_path: Path) -> Path:
    (tmp_path / "redis-url").write_text("redis://:s3cret@10.0.0.5:6379/0\n")
    (tmp_path / "voice-key").write_text("  voice-key-0123456789abcdef0123456789  \n")
    (tmp_path / "auth-secret").write_text("auth-secret-0123456789abcdef0123456789\n")
    return tmp_path


@pytest.fixture
def serve_env(secrets: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment CONFIG reads, set in the process as `cachelane serve` would find it."""
    monkeypatch.setenv("PORT", "9000")
    monkeypatch.setenv("SECRETS", str(secrets))
    monkeypatch.setenv("REPLICA_HOST", "10.0.0.7")


def write(tmp_path: Path, text: str = CONFIG) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return path


def test_variables_defaults_and_secret_files_are_resolved(tmp_path: Path, secrets: Path) -> None:
    env = {"PORT": "9000", "SECRETS": str(secrets), "REPLICA_HOST": "10.0.0.7"}
    config = load_config(write(tmp_path), env)
    assert (config.listen.host, config.listen.port) == ("127.0.0.1", 9000)
    assert config.index.redis_url == "redis://:s3cret@10.0.0.5:6379/0"
    assert str(config.pools[0].replicas[0]).startswith("http://10.0.0.7:8001")
    assert config.tenants[0].api_key == "voice-key-0123456789abcdef0123456789"
    # $$ is a literal $, an empty default is empty
    assert config.admin.api_key == "${literal}-0123456789abcdef0123456789"
    assert config.auth.secret == "auth-secret-0123456789abcdef0123456789"


def test_an_unset_variable_names_itself_and_where(tmp_path: Path, secrets: Path) -> None:
    with pytest.raises(ConfigError, match=r"listen\.port: environment variable PORT is not set"):
        load_config(write(tmp_path), {"SECRETS": str(secrets), "REPLICA_HOST": "h"})


def test_a_secret_file_that_cannot_be_read_is_an_error(tmp_path: Path) -> None:
    env = {"PORT": "1", "SECRETS": str(tmp_path / "nowhere"), "REPLICA_HOST": "h"}
    with pytest.raises(ConfigError, match=r"index\.redis_url_file: cannot read"):
        load_config(write(tmp_path), env)


def test_a_field_and_its_file_together_are_an_error(tmp_path: Path) -> None:
    text = "pools: [{name: p, replicas: ['http://h:1']}]\n"
    text += "admin: {api_key: x12345678, api_key_file: /f}\n"
    with pytest.raises(ConfigError, match="give api_key or api_key_file, not both"):
        load_config(write(tmp_path, text), {})


def test_check_config_exits_0_when_valid_and_2_with_the_errors(
    tmp_path: Path,
    serve_env: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    good = write(tmp_path)
    assert main(["check-config", str(good)]) == 0
    assert "valid; 1 pool(s), 1 replica(s), 1 tenant(s)" in capsys.readouterr().out

    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: [{name: p, replicas: [not-a-url]}]\nrouting: {policy: fastest}\n")
    assert main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "pools" in err and "routing.policy" in err  # every error, each with its path

    monkeypatch.setenv("CACHELANE_CONFIG", str(good))  # the default file
    assert main(["check-config"]) == 0


def test_check_config_takes_config_like_serve(
    tmp_path: Path, serve_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    good = write(tmp_path)
    assert main(["check-config", "--config", str(good)]) == 0
    assert "valid" in capsys.readouterr().out
    other = tmp_path / "other.yaml"
    assert main(["check-config", str(other), "--config", str(good)]) == 2  # which one?


@pytest.mark.parametrize("admin", [False, True], ids=["no-admin", "admin"])
def test_check_config_says_when_no_request_can_be_served(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], admin: bool
) -> None:
    text = "pools: [{name: p, replicas: ['http://h:1']}]\n"
    if admin:
        text += "admin: {api_key: " + "a" * 40 + "}\n"
    assert main(["check-config", str(write(tmp_path, text))]) == 0  # valid, and useless
    err = capsys.readouterr().err
    assert "no request can be served" in err and "auth.mode: open" in err
    assert ("/admin/tenants" in err) == admin
    opened = text if not admin else text.split("admin:")[0]
    assert main(["check-config", str(write(tmp_path, opened + "auth: {mode: open}\n"))]) == 0
    assert "no request can be served" not in capsys.readouterr().err


def test_check_config_says_why_a_removed_key_went(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = "pools: [{name: p, pinned: true, replicas: ['http://127.0.0.1:1'], lend_keep_idle: 1}]\n"
    assert main(["check-config", str(write(tmp_path, text))]) == 2
    err = capsys.readouterr().err
    assert "pools.0.lend_keep_idle (line 1): removed: delete it: measured no help" in err
    assert "on the token-budget engine (docs/critical.md" in err
