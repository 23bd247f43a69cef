"""Optional dependencies: which pip extra a feature needs, and a clear error when it is missing.

The plain `pip install cachelane` serves in approximate mode. Precise mode (engine KV events,
the model's tokenizer and chat template) needs `[precise]`; the simulator and the demo `[sim]`;
the benchmarks and Locust `[bench]`; OpenTelemetry tracing `[otel]` (pyproject.toml lists what each
brings).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

PRECISE_MODULES = ("tokenizers", "jinja2", "zmq", "msgpack")
# the simulator tokenizes and publishes KV events; the demo draws its progress with rich
SIM_MODULES = (*PRECISE_MODULES, "matplotlib", "rich")
OTEL_MODULES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")  # `tracing:`


def install_hint(extra: str) -> str:
    return f"pip install 'cachelane[{extra}]'"


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
