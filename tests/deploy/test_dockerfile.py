"""The Dockerfile, checked without a Docker engine: its structure statically, and what it builds
(the wheel from the .dockerignore'd context, then the image's entry point and healthcheck) by
doing the same steps on this machine."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.deploy.util import ROOT
from tests.helpers.ports import free_port

pytestmark = pytest.mark.slow  # `make check` leaves it out: builds the wheel

DOCKERFILE = ROOT / "Dockerfile"
BUILD_TOOLS = ("gcc", "g++", "build-essential", "make ", "clang", "python3-dev", "libc6-dev")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def _instructions(text: str) -> list[tuple[str, str]]:
    logical, out = "", []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            logical += stripped[:-1] + " "
            continue
        logical += stripped
        keyword, _, args = logical.partition(" ")
        out.append((keyword.upper(), args.strip()))
        logical = ""
    return out


def _stages() -> tuple[dict[str, str], list[Stage]]:
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, rest in _instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert m, rest
            base = re.sub(r"\$\{(\w+)\}", lambda v: args.get(v.group(1), v.group(0)), m.group(1))
            stages.append(Stage(base, m.group(2)))
        elif not stages and keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
        elif stages:
            stages[-1].instructions.append((keyword, rest))
    return args, stages


def test_multi_stage_with_a_slim_python_runtime() -> None:
    _, stages = _stages()
    assert len(stages) >= 2, "builder + runtime"
    assert stages[-1].base == "python:3.11-slim"
    assert stages[0].name == "builder"


def test_runtime_runs_as_non_root() -> None:
    final = _stages()[1][-1]
    users = final.all("USER")
    assert users, "the final stage sets USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    if user.isdigit():
        assert any(f"--uid {user}" in run for run in final.all("RUN")), "the uid is created"


def test_runtime_has_no_build_tools() -> None:
    final = _stages()[1][-1]
    text = " ".join(final.all("RUN")) + " "
    for tool in BUILD_TOOLS:
        assert tool not in text, f"the final stage installs {tool.strip()}"
    assert "apt-get install" not in text


def test_runtime_installs_only_this_project_from_the_builders_wheels() -> None:
    final = _stages()[1][-1]
    (install,) = [r for r in final.all("RUN") if "pip install" in r]
    assert "--no-index" in install and "from=builder" in install
    project = re.search(r'^name = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert project is not None
    assert re.search(rf"pip install .*\b{project.group(1)}\b", install)
    assert not final.all("COPY"), "nothing from the build context in the runtime stage"


def _stage(name: str) -> Stage:
    (stage,) = [s for s in _stages()[1] if s.name == name]
    return stage


def _installed_extras(stage: Stage) -> set[str]:
    (install,) = [r for r in stage.all("RUN") if "pip install" in r]
    match = re.search(r"'cachelane\[([a-z,]+)\]'", install)
    assert match, install
    return set(match.group(1).split(","))


def test_the_default_image_serves_only() -> None:
    """The last stage (`docker build .`'s target) is the gateway: no simulator, demo or Locust."""
    final = _stages()[1][-1]
    assert final.name == "runtime"
    assert _installed_extras(final) == {"precise", "otel"}
    assert "matplotlib" not in " ".join(v for _, v in final.instructions).lower()


def test_the_simulator_has_its_own_target() -> None:
    sim = _stage("sim")
    assert _installed_extras(sim) == {"sim"}
    assert json.loads(sim.all("ENTRYPOINT")[-1]) == ["cachelane", "sim"]
    assert sim.all("USER") and sim.all("USER")[-1].split(":")[0] not in ("root", "0")
    (health,) = sim.all("HEALTHCHECK")
    assert "127.0.0.1:9001/health" in health and sim.all("EXPOSE") == ["9001"]


def test_license_ships_with_the_wheel(wheel: Path) -> None:
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text  # the full text, not a notice
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()
    with zipfile.ZipFile(wheel) as z:
        (shipped,) = [n for n in z.namelist() if n.endswith("LICENSE") and ".dist-info/" in n]
        assert z.read(shipped).decode() == license_text


def test_healthcheck_entrypoint_and_port() -> None:
    final = _stages()[1][-1]
    (health,) = final.all("HEALTHCHECK")
    assert "/health" in health and "urllib" in health
    assert json.loads(final.all("ENTRYPOINT")[-1]) == ["cachelane"]
    assert json.loads(final.all("CMD")[-1]) == ["serve", "--config", "/etc/cachelane/config.yaml"]
    assert final.all("EXPOSE") == ["8000"]


def _healthcheck_argv() -> list[str]:
    final = _stages()[1][-1]
    (health,) = final.all("HEALTHCHECK")
    argv: list[str] = json.loads(health[health.index("CMD") + 3 :].strip())
    return argv


def _context_files() -> list[Path]:
    """The files `docker build .` sends, by .dockerignore (an allow-list after `*`)."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    kept = []
    for name in tracked:
        included = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            body = pattern.lstrip("!").rstrip("/")
            hit = fnmatch.fnmatch(name, body) or name.startswith(body + "/")
            if body.startswith("**/"):
                hit = fnmatch.fnmatch(name, body[3:]) or fnmatch.fnmatch(name, body)
            if hit:
                included = negate
        if included and (ROOT / name).is_file():
            kept.append(Path(name))
    return kept


def test_build_context_is_small_and_complete() -> None:
    names = {str(p) for p in _context_files()}
    assert "pyproject.toml" in names
    assert any(n.startswith("gateway/") for n in names)
    assert not any(n.startswith((".venv/", ".git/", "tests/", "deploy/")) for n in names)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip wheel` of the .dockerignore'd context: what the builder stage builds."""
    context = tmp_path_factory.mktemp("context")
    for name in _context_files():
        (context / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, context / name)
    out = tmp_path_factory.mktemp("wheels")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(context)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("*.whl")
    return built


def test_wheel_is_this_project_with_the_cli(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "Name: cachelane" in z.read(meta).decode()
        assert "cachelane = gateway.cli.main:main" in z.read(entry).decode()
    for package in ("gateway/http/app.py", "routing/decide.py", "loadtest/sim/fleet.py"):
        assert package in names, package


def test_image_entrypoint_starts_and_passes_its_healthcheck(wheel: Path, tmp_path: Path) -> None:
    """The runtime stage's steps, minus Docker: the wheel in a fresh venv (its dependencies taken
    from this venv), `cachelane serve --config ...` as the image's ENTRYPOINT + CMD run it, then
    the HEALTHCHECK command itself."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    deps = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (site / "zz_deps.pth").write_text(f"{deps}\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        "pools: [{name: p, replicas: ['http://127.0.0.1:9']}]\n"
    )
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl")}
    env.pop("PYTHONPATH", None)
    proc = subprocess.Popen(
        [str(venv / "bin" / "cachelane"), "serve", "--config", str(config)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        check = [
            str(venv / "bin" / "python") if a == "python" else a.replace(":8000/", f":{port}/")
            for a in _healthcheck_argv()
        ]
        deadline = time.monotonic() + 30
        while True:
            done = subprocess.run(check, cwd=tmp_path, capture_output=True, check=False)
            if done.returncode == 0:
                break
            assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
            assert time.monotonic() < deadline, done.stderr.decode()[-2000:]
            time.sleep(0.3)
        where = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import gateway; print(gateway.__file__)"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert where.startswith(str(venv)), f"gateway imported from {where}, not the wheel"
        hint = subprocess.run(
            [
                str(venv / "bin" / "python"),
                "-c",
                "from gateway.extras import install_hint; print(install_hint('sim'))",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert hint == f"pip install '{wheel}[sim]'"  # the wheel it came from, which has [sim]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_every_repository_path_its_comments_name_exists() -> None:
    path = r"(?<![\w/])((?:gateway|routing|loadtest|deploy|docs|tests)/[\w/.-]+\.\w+)"
    named = re.findall(path, DOCKERFILE.read_text())
    assert named, "the Dockerfile names no source file"
    assert [p for p in named if not (ROOT / p).exists()] == []
