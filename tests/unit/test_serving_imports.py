"""Serving loads only what serving needs: `cachelane serve` imports gateway.app and gateway.cli, and
neither may pull in the load-testing code or its heavy dependencies (`sim` and `demo` are imported
only when those commands run), so the plain `pip install cachelane` serves."""

import json
import subprocess
import sys

# Top-level packages the serving path must not import: the loadtest package, and what only the
# simulator, the demo, the benchmarks or Locust need (the [sim] / [bench] extras).
NOT_FOR_SERVING = ("loadtest", "matplotlib", "locust", "numpy")

PROBE = """
import json, sys
import gateway.app, gateway.cli
gateway.cli.build_parser()  # `cachelane --help` lists sim and demo without importing them
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def _loaded_top_level_modules() -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    return set(json.loads(done.stdout))


def test_gateway_app_and_cli_import_no_loadtest_or_its_dependencies() -> None:
    loaded = _loaded_top_level_modules()
    assert "gateway" in loaded  # the probe ran
    assert sorted(loaded.intersection(NOT_FOR_SERVING)) == []
