"""The routers the benchmarks compare: cachelane, sglang-router and vllm-router, as processes.

sglang-router and vllm-router are installed from PyPI into their own venv (ROUTERS_VENV), never
into cachelane's: `ensure_installed()` creates it and pip-installs the pinned versions, once. A
router that fails to install or start is reported by the caller, who goes on with the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.bench.processes import ManagedProcess, free_port, wait_ready

REPO = Path(__file__).resolve().parents[2]
ROUTERS_VENV = REPO / ".venv-routers"

EXTERNAL_PACKAGES = {"sglang": "sglang-router==0.3.2", "vllm": "vllm-router==0.1.17"}
# The versions docs/performance.md's comparisons were measured with; pinned so a run compares like
# with like.

EXTERNAL_POLICIES = {
    "sglang": ("cache_aware", "round_robin", "power_of_two"),
    "vllm": ("cache_aware", "round_robin", "consistent_hash"),
}
# vllm-router's kv_aware also needs the engines' KV event sockets: kv_aware_args().
BARE_POLICIES = ("round_robin", "cache_aware")  # the bare proxy; cache_aware: its --route
READY_PATHS = {"cachelane": "/ready", "bare": "/health"}  # the Rust routers: /v1/models
CACHELANE_POLICIES = ("round_robin", "least_loaded", "prefix_hash", "cache_aware")

PIP_TIMEOUT_S = 600.0  # wheels of both routers are ~10-20 MB each; a slow mirror takes minutes
START_TIMEOUT_S = 30.0  # both Rust routers probe every worker first; ~1 s here


@dataclass(frozen=True)
class RouterSpec:
    kind: str  # cachelane | bare (loadtest/bench/bare_proxy.py: the stack's floor) | sglang | vllm
    policy: str
    config: Path | None = None  # cachelane only: a YAML config instead of --replicas
    label_suffix: str = ""
    source: Path | None = None  # cachelane only: another checkout's tree to run (a baseline)
    workers: int = 1  # cachelane only: `serve --workers N`
    extra_args: tuple[str, ...] = ()  # appended to the router's command line

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.policy}{self.label_suffix}"


def with_workers(spec: RouterSpec, workers: int) -> RouterSpec:
    """cachelane `spec` served by `workers` processes, labelled e.g. cachelane:cache_aware+2w."""
    suffix = f"{spec.label_suffix}+{workers}w"
    return dataclasses.replace(spec, workers=workers, label_suffix=suffix)


def ensure_installed(kind: str) -> str | None:
    """Install one external router into ROUTERS_VENV if needed; None if ready, else why not
    (cachelane and the bare proxy run from this checkout: always ready)."""
    if kind not in EXTERNAL_PACKAGES:
        return None
    exe = ROUTERS_VENV / "bin" / f"{kind}-router"
    if exe.exists():
        return None
    try:
        if not (ROUTERS_VENV / "bin" / "pip").exists():
            subprocess.run(
                [sys.executable, "-m", "venv", str(ROUTERS_VENV)],
                check=True,
                capture_output=True,
                timeout=PIP_TIMEOUT_S,
            )
        subprocess.run(
            [str(ROUTERS_VENV / "bin" / "pip"), "install", "-q", EXTERNAL_PACKAGES[kind]],
            check=True,
            capture_output=True,
            text=True,
            timeout=PIP_TIMEOUT_S,
        )
    except subprocess.CalledProcessError as err:
        tail = (err.stderr or "").strip().splitlines()[-3:]
        return f"pip install {EXTERNAL_PACKAGES[kind]} failed: {' | '.join(tail)}"
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"cannot install {EXTERNAL_PACKAGES[kind]}: {err}"
    return None if exe.exists() else f"{exe} missing after pip install"


def router_args(spec: RouterSpec, replica_urls: Sequence[str], port: int) -> list[str]:
    if spec.kind == "cachelane":
        where = (
            ["--config", str(spec.config)]
            if spec.config
            else ["--replicas", ",".join(replica_urls)]
        )
        if spec.source is None:
            launch = [sys.executable, "-m", "gateway"]
        else:  # that tree's gateway and routing packages, ahead of this checkout's
            # `python -m gateway` of that tree, whatever its layout
            code = (
                f"import runpy, sys; sys.path.insert(0, {str(spec.source)!r}); "
                "runpy.run_module('gateway', run_name='__main__', alter_sys=True)"
            )
            launch = [sys.executable, "-c", code]
        workers = ["--workers", str(spec.workers)] if spec.workers > 1 else []
        return [
            *launch, "serve", *where, *workers,
            "--policy", spec.policy, "--port", str(port), "--log-level", "warning",
        ]  # fmt: skip
    if spec.kind == "bare":
        launch = [sys.executable, "-m", "loadtest.bench.bare_proxy"]
        route = ["--route"] if spec.policy == "cache_aware" else []
        return [*launch, "--replicas", ",".join(replica_urls), "--port", str(port), *route]
    exe = str(ROUTERS_VENV / "bin" / f"{spec.kind}-router")
    # Each Rust router also serves Prometheus metrics on a fixed default port (29000): two at
    # once collide, so every start gets a free one.
    common = [
        "--worker-urls", *replica_urls, "--policy", spec.policy,
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    if spec.kind == "sglang":
        return [exe, "launch", *common, "--log-level", "warn", *spec.extra_args]
    if spec.kind == "vllm":
        return [exe, *common, "--log-level", "warning", *spec.extra_args]
    raise ValueError(f"unknown router kind {spec.kind!r}")


def kv_aware_args(events: dict[str, str], block_size_tokens: int, model: str) -> tuple[str, ...]:
    """vllm-router kv_aware's flags: each worker's KV event endpoint (worker URL -> tcp://...),
    the engines' block size and model name (vllm-router 0.1.17 `--help`)."""
    sources = [
        a for url, endpoint in events.items() for a in ("--kv-event-source", f"{url}={endpoint}")
    ]
    return (
        *sources,
        "--kv-event-block-size", str(block_size_tokens),
        "--kv-event-model", model,
    )  # fmt: skip


@dataclass(frozen=True)
class RunningRouter:
    url: str
    pid: int | None  # for reading its CPU time (/proc/PID/stat)


@contextlib.contextmanager
def running_router(
    spec: RouterSpec, replica_urls: Sequence[str], log_dir: Path
) -> Iterator[RunningRouter]:
    """Start the router, wait until it answers (READY_PATHS, else /v1/models), yield
    its URL and pid, stop it."""
    port = free_port()
    name = spec.label.replace(":", "-")
    proc = ManagedProcess(
        spec.label, router_args(spec, replica_urls, port), log_dir / f"{name}.log"
    )
    url = f"http://127.0.0.1:{port}"
    ready = f"{url}{READY_PATHS.get(spec.kind, '/v1/models')}"
    try:
        proc.start()
        wait_ready(proc, [ready], timeout_s=START_TIMEOUT_S)
        yield RunningRouter(url, proc.pid)
    finally:
        proc.stop()
