"""Helpers shared by the deploy tests: paths, YAML loading, and whether a CLI is installed."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
K8S_DIR = DEPLOY / "k8s"


HELM_DIR = DEPLOY / "helm"


def yaml_files(under: Path) -> list[Path]:
    """YAML files under `under`, without Helm templates (Go templates, YAML once rendered:
    tests/deploy/test_helm.py)."""
    return sorted(
        p
        for ext in ("*.yaml", "*.yml")
        for p in under.rglob(ext)
        if not (p.is_relative_to(HELM_DIR) and "templates" in p.relative_to(HELM_DIR).parts)
    )


def load_docs(path: Path) -> list[Any]:
    """Every document of a (possibly multi-document) YAML file, empty documents dropped."""
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def load_one(path: Path) -> Any:
    docs = load_docs(path)
    assert len(docs) == 1, f"{path}: expected one YAML document, found {len(docs)}"
    return docs[0]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def cli_answers(*command: str) -> bool:
    """Whether `command` runs and exits 0 (a tool that is installed and has the subcommand)."""
    return subprocess.run(command, capture_output=True, check=False).returncode == 0
