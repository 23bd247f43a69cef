"""Reading a config: YAML from a file (${VAR} and *_file secrets resolved), validation with the
failing key's path, and the config `serve --replicas` builds."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import yaml
from pydantic import ValidationError

from gateway import config_env
from gateway.config.root import GatewayConfig
from routing.decide import Policy


class ConfigError(Exception):
    """The config file is missing, not YAML, or fails validation; the message names the key."""


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {where}: {e['msg']}")
    return "\n".join(lines)


def parse_config(data: object, source: str = "config") -> GatewayConfig:
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source} is invalid:\n{_describe(err)}") from None


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> GatewayConfig:
    """Read, resolve (`${VAR}`, `*_file` secrets: gateway/config_env.py) and validate a config."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read config {p}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{p} is not valid YAML: {err}") from None
    try:
        data = config_env.resolve(data, os.environ if env is None else env)
    except config_env.EnvError as err:
        raise ConfigError(f"{p}: {err}") from None
    return parse_config(data, str(p))


def quick_config(
    replica_urls: list[str], *, policy: Policy = Policy.CACHE_AWARE, host: str, port: int
) -> GatewayConfig:
    """Config for `cachelane serve --replicas ...`: one pool, defaults everywhere, auth open."""
    return parse_config(
        {
            "listen": {"host": host, "port": port},
            "routing": {"policy": policy.value},
            "auth": {"mode": "open"},  # a quick start: no tenants, so no keys to check
            # a quick start shows every client why it went where it went
            "exposure": {"decision_headers": "all", "estimate_headers": "all"},
            "pools": [{"name": "default", "replicas": replica_urls}],
        },
        "--replicas",
    )
