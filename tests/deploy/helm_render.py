"""A small renderer for the subset of Helm's Go templates deploy/helm/cachelane uses, for tests on
machines without the helm binary (none installs from apt, pip or npm here).

What it takes: text and `{{ ... }}` actions with `{{-` / `-}}` whitespace trimming; `if` / `else`
/ `end` on a value's truth (Go's: false, 0, "", nil and empty collections are false); pipelines
`a | f x | g` where a step's output is the last argument of the next, as in Go templates; values
`.Values.a.b`, `.Release.Name`, `.Release.Namespace`, `.Chart.Name`, `.Chart.Version`,
`.Chart.AppVersion`, string and integer literals; functions `toYaml`, `nindent`, `indent`,
`quote`, `default`, `b64enc`, `sha256sum`, `required`, and `.Files.Get "path"`. Anything else is
an error, so a chart that grows past the subset fails its tests instead of rendering wrong.
"""

from __future__ import annotations

import base64
import hashlib
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


class TemplateError(ValueError):
    pass


def load_chart(chart: Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The root context: Chart.yaml, values.yaml deep-merged with `overrides`, the release."""
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    values = _merge(yaml.safe_load((chart / "values.yaml").read_text()) or {}, overrides or {})
    return {
        "Values": values,
        "Release": {"Name": "cachelane", "Namespace": "cachelane", "Service": "Helm"},
        "Chart": {
            "Name": meta["name"],
            "Version": meta["version"],
            "AppVersion": meta["appVersion"],
        },
        "Files": {"root": chart},
    }


def render_chart(chart: Path, overrides: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every object the chart's templates render (files starting with `_` are helpers)."""
    context = load_chart(chart, overrides)
    objects: list[dict[str, Any]] = []
    for path in sorted((chart / "templates").glob("*.yaml")):
        text = render(path.read_text(), context)
        objects += [d for d in yaml.safe_load_all(text) if d]
    return objects


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def render(template: str, context: dict[str, Any]) -> str:
    pieces: list[str | tuple[str]] = []  # text, or (action,)
    pos = 0
    for match in _ACTION.finditer(template):
        text = template[pos : match.start()]
        if match.group(1):
            text = text.rstrip(" \t\n")
        if pieces and isinstance(pieces[-1], str) and pieces[-1] == "\0trim":
            pieces.pop()
            text = text.lstrip(" \t\n")
        pieces.append(text)
        pieces.append((match.group(2),))
        if match.group(3):
            pieces.append("\0trim")
        pos = match.end()
    tail = template[pos:]
    if pieces and pieces[-1] == "\0trim":
        pieces.pop()
        tail = tail.lstrip(" \t\n")
    pieces.append(tail)
    out, rest = _run(pieces, 0, context)
    if rest != len(pieces):
        raise TemplateError("an `else` or `end` without its `if`")
    return out


def _run(pieces: list[str | tuple[str]], i: int, ctx: dict[str, Any]) -> tuple[str, int]:
    """Render from piece i until an `else` / `end` at this level (its index is returned)."""
    out: list[str] = []
    while i < len(pieces):
        piece = pieces[i]
        if isinstance(piece, str):
            out.append(piece)
            i += 1
            continue
        action = piece[0]
        if action in ("else", "end"):
            return "".join(out), i
        if action.startswith("if "):
            chosen = _truthy(_pipeline(action[3:], ctx))
            then, i = _run(pieces, i + 1, ctx)
            other = ""
            if i < len(pieces) and pieces[i] == ("else",):
                other, i = _run(pieces, i + 1, ctx)
            if i >= len(pieces) or pieces[i] != ("end",):
                raise TemplateError(f"`{action}` without `end`")
            out.append(then if chosen else other)
            i += 1
            continue
        if action.startswith("/*"):  # a comment
            i += 1
            continue
        value = _pipeline(action, ctx)
        out.append("" if value is None else str(value))
        i += 1
    return "".join(out), i


def _truthy(value: Any) -> bool:
    return value not in (None, False, 0, "") and not (hasattr(value, "__len__") and not len(value))


def _pipeline(text: str, ctx: dict[str, Any]) -> Any:
    steps = [shlex.split(step, posix=False) for step in _split_pipes(text)]
    value: Any = None
    for n, words in enumerate(steps):
        args = [_value(w, ctx) for w in words[1:]]
        if n:
            args.append(value)
        head = words[0]
        if head in _FUNCTIONS:
            value = _FUNCTIONS[head](*args)
        elif head == ".Files.Get":
            (name,) = args
            value = (ctx["Files"]["root"] / name).read_text()
        elif len(words) == 1 and n == 0:
            value = _value(head, ctx)
        else:
            raise TemplateError(f"unsupported: {text!r}")
    return value


def _split_pipes(text: str) -> list[str]:
    parts, current, quoted = [], "", False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        if ch == "|" and not quoted:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    parts.append(current.strip())
    return parts


def _value(word: str, ctx: dict[str, Any]) -> Any:
    if word.startswith('"') and word.endswith('"'):
        return word[1:-1]
    if re.fullmatch(r"-?\d+", word):
        return int(word)
    if word.startswith("."):
        node: Any = ctx
        for key in word[1:].split("."):
            node = node.get(key) if isinstance(node, dict) else None
        return node
    raise TemplateError(f"unsupported value {word!r}")


def _indent(n: int, text: Any) -> str:
    return "\n".join(" " * n + line if line else line for line in str(text).split("\n"))


def _to_yaml(value: Any) -> str:
    return yaml.safe_dump(value, sort_keys=True, default_flow_style=False).rstrip("\n")


def _required(message: str, value: Any) -> Any:
    if not _truthy(value):
        raise TemplateError(message)
    return value


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "toYaml": _to_yaml,
    "indent": _indent,
    "nindent": lambda n, text: "\n" + _indent(n, text),
    "quote": lambda value: '"' + str(value).replace('"', '\\"') + '"',
    "default": lambda fallback, value: value if _truthy(value) else fallback,
    "b64enc": lambda value: base64.b64encode(str(value).encode()).decode(),
    "sha256sum": lambda value: hashlib.sha256(str(value).encode()).hexdigest(),
    "required": _required,
}
