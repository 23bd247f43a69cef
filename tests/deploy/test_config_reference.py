"""deploy/CONFIG.md documents every key of gateway.config.GatewayConfig and is up to date."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    path = ROOT / "deploy" / "gen_config_reference.py"
    spec = importlib.util.spec_from_file_location("gen_config_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


GEN = _generator()


def test_every_key_has_a_meaning() -> None:
    missing = GEN.undocumented()
    assert not missing, (
        f"config keys without a description: {missing}; add them to DESCRIPTIONS in "
        "deploy/gen_config_reference.py (or give the pydantic Field a description)"
    )


def test_config_md_is_current() -> None:
    expected = GEN.render()
    actual = (ROOT / "deploy" / "CONFIG.md").read_text()
    assert actual == expected, (
        "deploy/CONFIG.md is out of date with gateway/config/; regenerate it: "
        ".venv/bin/python deploy/gen_config_reference.py > deploy/CONFIG.md"
    )


def test_every_key_is_in_config_md() -> None:
    text = (ROOT / "deploy" / "CONFIG.md").read_text()
    for path, *_ in GEN.rows(GEN.GatewayConfig):
        assert f"| `{path}` |" in text, path


def test_descriptions_name_only_existing_keys() -> None:
    paths = {path for path, *_ in GEN.rows(GEN.GatewayConfig)}
    stale = sorted(set(GEN.DESCRIPTIONS) - paths)
    assert not stale, f"DESCRIPTIONS has keys the config no longer has: {stale}"


def test_the_reference_speaks_the_files_language() -> None:
    """Types as a config file writes them (no Python type names), and the environment it reads."""
    text = (ROOT / "deploy" / "CONFIG.md").read_text()
    assert "dict[" not in text and "routing.types." not in text
    assert "reads no environment variables" not in text
    assert "${VAR}" in text and "_file: PATH" in text and "CACHELANE_CONFIG" in text
