"""A Python stand-in for `kustomize build`'s structural checks, for machines without kustomize.

It does not render; it checks what rendering would trip over: every kustomization's resources
exist and parse (files, or directories with their own kustomization), generator files exist,
generators with `behavior: replace|merge` name a generator of a base, and every patch targets an
object that the base resources define.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.deploy.util import load_docs, load_one

KUSTOMIZATION_NAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")


@dataclass
class Tree:
    """What one kustomization (with its bases) contributes."""

    objects: list[dict[str, Any]] = field(default_factory=list)
    # name -> files: replace (and create) take the last, merge adds to the base's
    generators: dict[str, list[Path]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def kustomization_file(directory: Path) -> Path | None:
    for name in KUSTOMIZATION_NAMES:
        if (directory / name).is_file():
            return directory / name
    return None


def _object_key(obj: dict[str, Any]) -> tuple[str, str]:
    return obj.get("kind", ""), obj.get("metadata", {}).get("name", "")


def check(directory: Path, _seen: tuple[Path, ...] = ()) -> Tree:
    tree = Tree()
    path = kustomization_file(directory)
    if path is None:
        tree.errors.append(f"{directory}: no kustomization.yaml")
        return tree
    if directory.resolve() in _seen:
        tree.errors.append(f"{directory}: resource cycle")
        return tree
    k = load_one(path)
    for entry in k.get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            sub = check(target, (*_seen, directory.resolve()))
            tree.objects += sub.objects
            tree.errors += sub.errors
            for name, files in sub.generators.items():
                tree.generators[name] = files
        elif target.is_file():
            docs = load_docs(target)
            for doc in docs:
                if not (isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind")):
                    tree.errors.append(f"{target}: a document without apiVersion/kind")
            tree.objects += docs
        else:
            tree.errors.append(f"{path}: resource {entry!r} does not exist")
    for kind in ("configMapGenerator", "secretGenerator"):
        for gen in k.get(kind, []):
            name, behavior = gen["name"], gen.get("behavior", "create")
            files = []
            for f in gen.get("files", []):
                source = directory / f.split("=", 1)[-1]
                if not source.is_file():
                    tree.errors.append(f"{path}: {kind} {name}: file {f!r} does not exist")
                files.append(source)
            if behavior in ("replace", "merge") and name not in tree.generators:
                tree.errors.append(
                    f"{path}: {kind} {name} has behavior {behavior} but no base defines it"
                )
            if behavior == "create" and name in tree.generators:
                tree.errors.append(f"{path}: {kind} {name} is created twice")
            if behavior == "merge":
                kept = [
                    f
                    for f in tree.generators.get(name, [])
                    if f.name not in {n.name for n in files}
                ]
                files = kept + files
            tree.generators[name] = files
    known = {_object_key(o) for o in tree.objects}
    for patch in k.get("patches", []) + k.get("patchesStrategicMerge", []):
        entry = patch if isinstance(patch, dict) else {"path": patch}
        targets = []
        if "path" in entry:
            source = directory / entry["path"]
            if not source.is_file():
                tree.errors.append(f"{path}: patch {entry['path']!r} does not exist")
                continue
            patch_docs = load_docs(source)
            if "target" not in entry:
                targets = [_object_key(d) for d in patch_docs if isinstance(d, dict)]
        if "target" in entry:
            targets = [(entry["target"].get("kind", ""), entry["target"].get("name", ""))]
        for target in targets:
            if target not in known:
                tree.errors.append(f"{path}: patch targets {target}, which no resource defines")
    return tree
