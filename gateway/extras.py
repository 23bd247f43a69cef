"""Optional dependencies: which pip extra a feature needs, and a clear error when it is missing.

The plain install serves in approximate mode. Precise mode (engine KV events, the model's
tokenizer and chat template) needs `[precise]`; the simulator, the demo and the plots `[sim]`;
the benchmarks and Locust `[bench]`; OpenTelemetry tracing `[otel]` (pyproject.toml lists what each
brings).

The hint names what installed this cachelane, since the package is not on PyPI: pip's record of
it (PEP 610 direct_url.json: a checkout, editable or not, a wheel or archive file, a VCS URL),
or the checkout this module sits in when it runs uninstalled; by name only when it came from an
index (a private one).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlsplit

DISTRIBUTION = "cachelane"
CHECKOUT = Path(__file__).resolve().parents[1]  # the repository root, when run from a checkout

PRECISE_MODULES = ("tokenizers", "jinja2", "zmq", "msgpack")
# the simulator tokenizes and publishes KV events; the demo draws its progress with rich
SIM_MODULES = (*PRECISE_MODULES, "matplotlib", "rich")
OTEL_MODULES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")  # `tracing:`


def install_hint(extra: str) -> str:
    """The pip command that adds `extra` to this cachelane, however it was installed."""
    # Every metadata directory of the name, not only the first on sys.path: a checkout holds the
    # cachelane.egg-info that setuptools' editable build leaves there, with no install record,
    # ahead of the installed one when the checkout's root is on sys.path (pytest, python -m).
    found = list(metadata.distributions(name=DISTRIBUTION))
    if not found:  # run from a checkout without installing it
        if (CHECKOUT / "pyproject.toml").is_file():
            return f"pip install -e '{CHECKOUT}[{extra}]'"
        return f"pip install '{DISTRIBUTION}[{extra}]'"
    record = next((r for d in found if (r := d.read_text("direct_url.json")) is not None), None)
    if record is None:  # from an index, by name
        return f"pip install '{DISTRIBUTION}[{extra}]'"
    return _hint_from_record(json.loads(record), extra)


def _hint_from_record(record: dict[str, object], extra: str) -> str:
    """PEP 610's record: a local directory or file by its path, anything else by reference."""
    url = str(record.get("url", ""))
    parts = urlsplit(url)
    vcs = record.get("vcs_info")
    if parts.scheme == "file" and vcs is None:
        path = unquote(parts.path)
        dir_info = record.get("dir_info")
        editable = isinstance(dir_info, dict) and dir_info.get("editable") is True
        return f"pip install {'-e ' if editable else ''}'{path}[{extra}]'"
    if isinstance(vcs, dict) and "vcs" in vcs:
        url = f"{vcs['vcs']}+{url}"
    return f"pip install '{DISTRIBUTION}[{extra}] @ {url}'"


def missing_message(feature: str, extra: str, missing: Sequence[str]) -> str:
    return (
        f"{feature} needs the [{extra}] extra (missing: {', '.join(missing)}): "
        f"{install_hint(extra)}"
    )


def missing_modules(modules: Sequence[str]) -> list[str]:
    """Those of `modules` that are not installed (found without importing them; a dotted name's
    parent packages are imported, and a missing parent makes it missing)."""
    return [m for m in modules if not _found(m)]


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False
