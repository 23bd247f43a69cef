"""What a config file may take from its environment, resolved before validation.

- `${VAR}` and `${VAR:-default}` in any string value (not in keys), as in docker compose and
  Kubernetes manifests; `$$` is a literal `$`. A variable that is unset, with no default, is an
  error naming it and where it is used. A value that is only `${VAR}` keeps the variable's text
  as a string: pydantic then converts "8000" to a port like any other YAML string.
- `<field>_file: PATH` for the secret fields (SECRET_FIELDS): the field takes the file's
  content, stripped of surrounding whitespace, the way Kubernetes Secrets and docker secrets are
  mounted. Giving both the field and its `_file` is an error.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

SECRET_FIELDS = frozenset({"api_key", "redis_url", "secret"})
# tenants[].api_key, admin.api_key, index.redis_url, auth.secret

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class EnvError(ValueError):
    """A variable that is not set, a secret file that cannot be read, a field given twice."""


def resolve(data: Any, env: Mapping[str, str], path: str = "") -> Any:
    """`data` (parsed YAML) with variables substituted and `*_file` secrets read."""
    if isinstance(data, dict):
        out: dict[Any, Any] = {}
        for key, value in data.items():
            where = f"{path}.{key}" if path else str(key)
            field = key.removesuffix("_file") if isinstance(key, str) else key
            if isinstance(key, str) and key != field and field in SECRET_FIELDS:
                if field in data:
                    raise EnvError(f"{where}: give {field} or {key}, not both")
                out[field] = _read_secret(resolve(value, env, where), where)
            else:
                out[key] = resolve(value, env, where)
        return out
    if isinstance(data, list):
        return [resolve(v, env, f"{path}[{i}]") for i, v in enumerate(data)]
    if isinstance(data, str):
        return _substitute(data, env, path)
    return data


def _substitute(text: str, env: Mapping[str, str], where: str) -> str:
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, default = match.group(1), match.group(2)
        value = env.get(name)
        if value is None or (value == "" and default is not None):
            if default is None:
                raise EnvError(f"{where}: environment variable {name} is not set")
            return default
        return value

    replace: Callable[[re.Match[str]], str] = one
    return _VAR.sub(replace, text)


def _read_secret(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise EnvError(f"{where}: expected a file path")
    try:
        return Path(value).read_text().strip()
    except OSError as err:
        raise EnvError(f"{where}: cannot read {value}: {err.strerror}") from None
