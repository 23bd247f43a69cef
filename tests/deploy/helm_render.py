"""A small renderer for the subset of Helm's Go templates deploy/helm/cachelane uses, for tests on
machines without the helm binary (none installs from apt, pip or npm here).

What it takes: text and `{{ ... }}` actions with `{{-` / `-}}` whitespace trimming; `if` / `else`
/ `end` on a value's truth (Go's: false, 0, "", nil and empty collections are false); pipelines
`a | f x | g` where a step's output is the last argument of the next, as in Go templates, and
an argument may be a parenthesized pipeline; values `.Values.a.b`, `.Release.Name`,
`.Release.Namespace`, `.Chart.Name`, `.Chart.Version`, `.Chart.AppVersion`, string and integer
literals; functions `toYaml`, `nindent`, `indent`, `quote`, `default`, `b64enc`, `sha256sum`,
`required`, `and`, `or`, `not`, `eq`, `gt`, `contains`, `printf` (%s, %d), `fail`,
`.Files.Get "path"` and
`.Capabilities.APIVersions.Has "group/version"` (the cluster's API versions: `api_versions`).
Anything else is an error, so a chart that grows past the subset fails its tests instead of
rendering wrong.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[()|]|[^\s()|"]+')
KUBERNETES_API_VERSIONS = frozenset(
    {"v1", "apps/v1", "autoscaling/v2", "policy/v1", "networking.k8s.io/v1"}
)  # what every cluster this chart supports serves
PROMETHEUS_OPERATOR = "monitoring.coreos.com/v1"  # ServiceMonitor and PrometheusRule


class TemplateError(ValueError):
    pass


def load_chart(
    chart: Path,
    overrides: dict[str, Any] | None = None,
    api_versions: frozenset[str] = KUBERNETES_API_VERSIONS | {PROMETHEUS_OPERATOR},
    release: str = "cachelane",
) -> dict[str, Any]:
    """The root context: Chart.yaml, values.yaml deep-merged with `overrides`, the release (its
    name: `release`), the cluster's API versions (by default one with the Prometheus Operator's
    CRDs)."""
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    values = _merge(yaml.safe_load((chart / "values.yaml").read_text()) or {}, overrides or {})
    return {
        "Values": values,
        "Release": {"Name": release, "Namespace": "cachelane", "Service": "Helm"},
        "Chart": {
            "Name": meta["name"],
            "Version": meta["version"],
            "AppVersion": meta["appVersion"],
        },
        "Files": {"root": chart},
        "Capabilities": {"APIVersions": api_versions},
    }


def render_chart(
    chart: Path,
    overrides: dict[str, Any] | None = None,
    api_versions: frozenset[str] | None = None,
    release: str = "cachelane",
) -> list[dict[str, Any]]:
    """Every object the chart's templates render (files starting with `_` are helpers)."""
    context = load_chart(chart, overrides, KUBERNETES_API_VERSIONS | {PROMETHEUS_OPERATOR}, release)
    if api_versions is not None:
        context["Capabilities"]["APIVersions"] = api_versions
    objects: list[dict[str, Any]] = []
    for path in sorted((chart / "templates").glob("*.yaml")):
        text = render(path.read_text(), context)
        objects += [d for d in yaml.safe_load_all(text) if d]
    return objects


def render_notes(
    chart: Path,
    overrides: dict[str, Any] | None = None,
    api_versions: frozenset[str] | None = None,
    release: str = "cachelane",
) -> str:
    """templates/NOTES.txt as `helm install` prints it."""
    context = load_chart(chart, overrides, KUBERNETES_API_VERSIONS | {PROMETHEUS_OPERATOR}, release)
    if api_versions is not None:
        context["Capabilities"]["APIVersions"] = api_versions
    return render((chart / "templates" / "NOTES.txt").read_text(), context)


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
    tokens = _TOKEN.findall(text)
    if "".join(tokens) != re.sub(r"\s+", "", text):
        raise TemplateError(f"unsupported: {text!r}")
    value, rest = _run_pipeline(tokens, ctx)
    if rest:
        raise TemplateError(f"unbalanced parentheses: {text!r}")
    return value


def _run_pipeline(tokens: list[str], ctx: dict[str, Any]) -> tuple[Any, list[str]]:
    """A pipeline from `tokens` up to an unmatched `)` (the tokens after it are returned)."""
    value: Any = None
    n = 0
    while tokens and tokens[0] != ")":
        words: list[Any] = []  # a command: its head, then its arguments (values already)
        while tokens and tokens[0] not in ("|", ")"):
            token = tokens.pop(0)
            if token == "(":
                inner, tokens = _run_pipeline(tokens, ctx)
                if not tokens or tokens.pop(0) != ")":
                    raise TemplateError("a `(` without its `)`")
                words.append(("value", inner))
            else:
                words.append(token)
        if tokens and tokens[0] == "|":
            tokens.pop(0)
        value = _command(words, ctx, (value,) if n else ())
        n += 1
    return value, tokens


def _command(words: list[Any], ctx: dict[str, Any], piped: tuple[Any, ...]) -> Any:
    if not words:
        raise TemplateError("an empty command")
    head, *rest = words
    args = [w[1] if isinstance(w, tuple) else _value(w, ctx) for w in rest] + list(piped)
    if isinstance(head, tuple):  # a parenthesized value alone
        if args:
            raise TemplateError("a value cannot take arguments")
        return head[1]
    if head in _FUNCTIONS:
        return _FUNCTIONS[head](*args)
    if head == ".Files.Get":
        (name,) = args
        return (ctx["Files"]["root"] / name).read_text()
    if head == ".Capabilities.APIVersions.Has":
        (version,) = args
        return version in ctx["Capabilities"]["APIVersions"]
    if not args:
        return _value(head, ctx)
    raise TemplateError(f"unsupported: {head!r} with arguments")


def _value(word: str, ctx: dict[str, Any]) -> Any:
    if word.startswith('"') and word.endswith('"'):
        return word[1:-1].replace('\\"', '"')
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


def _fail(message: str) -> Any:
    raise TemplateError(message)


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
    "fail": _fail,
    # Go's and / or: the first falsy (truthy) argument, else the last
    "and": lambda *args: next((a for a in args if not _truthy(a)), args[-1]),
    "or": lambda *args: next((a for a in args if _truthy(a)), args[-1]),
    "not": lambda value: not _truthy(value),
    "eq": lambda a, *others: any(a == b for b in others),
    "gt": lambda a, b: a > b,
    "contains": lambda part, text: str(part) in str(text),
    "printf": lambda fmt, *args: fmt % args,  # %s and %d, as Go's
}
