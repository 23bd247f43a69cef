"""Reading a config: YAML from a file (${VAR} and *_file secrets resolved), validation with every
failing key's path (and its line in the file), and the config `serve --replicas` builds."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml
from pydantic import ValidationError

from gateway import config_env
from gateway.config.root import GatewayConfig
from gateway.config.upgrades import unknown_key
from routing.decide import Policy


class ConfigError(Exception):
    """The config file is missing, not YAML, or fails validation; the message names the key."""


Lines = dict[tuple[int | str, ...], int]  # a key's path in the file -> its line (1-based)


def _describe(err: ValidationError, lines: Lines) -> str:
    """Every error, one a line: the key's path, its line in the file when known, what is wrong
    (for a key the config does not take: what replaced it, or the key it is closest to)."""
    out = []
    for e in err.errors():
        loc = tuple(e["loc"])
        where = ".".join(str(p) for p in loc) or "(top level)"
        line = _line_of(loc, lines)
        if line is not None:
            where += f" (line {line})"
        message = unknown_key(GatewayConfig, loc) if e["type"] == "extra_forbidden" else e["msg"]
        out.append(f"  {where}: {message}")
    return "\n".join(out)


def _line_of(loc: Sequence[int | str], lines: Lines) -> int | None:
    """The line of the key at `loc`, or of the nearest section around it that the file has."""
    for end in range(len(loc), 0, -1):
        line = lines.get(tuple(loc[:end]))
        if line is not None:
            return line
    return None


def _key_lines(node: yaml.Node | None, path: tuple[int | str, ...] = ()) -> Lines:
    """Where each key and list item of a composed YAML document starts."""
    out: Lines = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            here = (*path, str(key.value))
            out[here] = key.start_mark.line + 1
            out.update(_key_lines(value, here))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[(*path, i)] = item.start_mark.line + 1
            out.update(_key_lines(item, (*path, i)))
    return out


def parse_config(data: object, source: str = "config", lines: Lines | None = None) -> GatewayConfig:
    """Validate parsed data; ConfigError lists every error (`lines`: where each key is in the
    file, for the messages)."""
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source} is invalid:\n{_describe(err, lines or {})}") from None


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> GatewayConfig:
    """Read, resolve (`${VAR}`, `*_file` secrets: gateway/config_env.py) and validate a config."""
    p = Path(path)
    try:
        with p.open() as stream:  # a named stream: YAML errors say the file, line and column
            data = yaml.safe_load(stream)
            stream.seek(0)
            lines = _key_lines(yaml.compose(stream))
    except OSError as err:
        raise ConfigError(f"cannot read config {p}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{p} is not valid YAML: {err}") from None
    try:
        data = config_env.resolve(data, os.environ if env is None else env)
    except config_env.EnvError as err:
        raise ConfigError(f"{p}: {err}") from None
    return parse_config(data, str(p), lines)


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
