"""Serving loads only what serving needs: `cachelane serve` imports gateway.http.app and
gateway.cli.main, and neither may pull in the load-testing code or its heavy dependencies (`sim` and
`demo` are imported only when those commands run), so the plain `pip install cachelane` serves."""

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gateway.extras as extras_module
from gateway.config import ConfigError, parse_config
from gateway.extras import PRECISE_MODULES, install_hint
from loadtest.sim.tiny_tokenizer import write_tiny_tokenizer

# Top-level packages the serving path must not import: the loadtest package, and what only the
# simulator, the demo, the benchmarks or Locust need (the [sim] / [bench] extras). numpy (the cost
# fit solves its four terms in pure Python) and rich (the command line draws plain-text tables)
# are not in the plain install either.
NOT_FOR_SERVING = ("loadtest", "matplotlib", "locust", "numpy", "rich")

PROBE = """
import json, sys
for name in sys.argv[1:]:  # as if not installed: importing it raises ImportError
    sys.modules[name] = None
import gateway.http.app, gateway.cli.main, gateway.cli.plan, gateway.cli.report
gateway.cli.main.build_parser()  # `cachelane --help` lists sim and demo without importing them
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules if sys.modules[name]})))
"""

# The dev environment has the extras, and some libraries import what they find: httpx imports
# rich for its command line when rich is installed. The probe hides these, as the plain install
# does not have them: the serving path must import without them, and not try to.
NOT_INSTALLED_PLAINLY = ("numpy", "rich")


@functools.cache  # one probe per set of hidden modules: each takes seconds
def _loaded_top_level_modules(*hidden: str) -> frozenset[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *hidden],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"the serving path failed to import:\n{done.stderr}"
    return frozenset(json.loads(done.stdout))


def test_gateway_app_and_cli_import_no_loadtest_or_its_dependencies() -> None:
    loaded = _loaded_top_level_modules(*NOT_INSTALLED_PLAINLY)
    assert "gateway" in loaded  # the probe ran
    assert sorted(loaded.intersection(NOT_FOR_SERVING)) == []


def test_serving_imports_no_numpy_even_where_it_is_installed() -> None:
    """numpy is installed here (the benchmarks): nothing on the serving path reaches for it."""
    assert "numpy" not in _loaded_top_level_modules()


def test_serving_imports_no_precise_extra_module() -> None:
    """Approximate mode runs on the plain install: jinja2, tokenizers, pyzmq and msgpack (the
    [precise] extra) are imported only when routing.mode is precise."""
    loaded = _loaded_top_level_modules(*NOT_INSTALLED_PLAINLY)
    assert sorted(loaded.intersection(PRECISE_MODULES)) == []


def test_precise_mode_without_the_extra_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = write_tiny_tokenizer(tmp_path)
    pool = {
        "name": "p",
        "models": ["m"],
        "replicas": ["http://127.0.0.1:8001"],
        "kv_events": {"port_offset": 1000},
        "tokenizer": {"path": str(files.tokenizer_json), "chat_template": str(files.chat_template)},
    }
    data = {"routing": {"mode": "precise"}, "pools": [pool]}
    parse_config(data)  # installed here: accepted
    monkeypatch.setattr(extras_module, "missing_modules", lambda modules: ["tokenizers"])
    with pytest.raises(ConfigError, match=re.escape(install_hint("precise"))):
        parse_config(data)


def test_tracing_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    off = {"pools": [{"name": "p", "replicas": ["http://127.0.0.1:8001"]}]}
    on = {**off, "tracing": {"enabled": True}}
    parse_config(on)  # installed here: accepted
    monkeypatch.setattr(extras_module, "missing_modules", lambda modules: ["opentelemetry.sdk"])
    assert not parse_config(off).tracing.enabled  # off: the extra is not needed
    with pytest.raises(ConfigError, match=re.escape(install_hint("otel"))):
        parse_config(on)
