"""Start and stop the demo's processes on loopback: a simulated fleet and a gateway per policy.

Each process runs in its own session (so a terminal's Ctrl-C reaches only us, and we stop the
children in order), writes stdout and stderr to a log file, and is stopped with SIGTERM to its
process group, then SIGKILL after a grace period. On Linux a child also gets SIGTERM if this
process dies without running its `finally` blocks (PR_SET_PDEATHSIG), so nothing is orphaned.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import yaml

START_TIMEOUT_S = 30.0
# A sim fleet or a gateway imports FastAPI/uvicorn and binds in ~1-2 s; 30 s covers a loaded
# 2-core machine that is also running the other processes.

STOP_TIMEOUT_S = 8.0
# uvicorn's graceful shutdown waits for open streams; the sim fleet gives them 5 s
# (loadtest/sim/fleet.py GRACEFUL_SHUTDOWN_S), so 8 s leaves room before SIGKILL.

POLL_INTERVAL_S = 0.1  # readiness polling: fast enough not to add visible delay
HTTP_TIMEOUT_S = 2.0  # one readiness / reset call on loopback
PORT_RANGE = (20_000, 30_000)  # below Linux's ephemeral range (32768-60999): no client collides
PORT_SEARCH_TRIES = 200  # attempts to find a free run of consecutive ports

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _pdeathsig_hook() -> Callable[[], None] | None:
    """A preexec_fn that asks Linux to SIGTERM the child when its parent dies, or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: the child only calls it
    except OSError:
        return None

    def hook() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return hook


_RECENT_PORTS = 2_000  # ports this process handed out lately, not handed out again


_recent: collections.deque[int] = collections.deque(maxlen=_RECENT_PORTS)


def free_port() -> int:
    """A loopback TCP port that was free a moment ago: below the ephemeral range, so no
    outgoing connection takes it before its server binds it (the OS's own pick, binding port 0,
    comes from that range, and a test's client connection once took a sim's port in between)."""
    return free_port_run(1)


def free_port_run(count: int) -> int:
    """The first of `count` consecutive loopback ports that were all free a moment ago and were
    not handed out by this process lately (two servers started one after the other must not get
    the same port before either binds it)."""
    rng = random.Random()
    for _ in range(PORT_SEARCH_TRIES):
        start = rng.randrange(PORT_RANGE[0], PORT_RANGE[1] - count)
        run = range(start, start + count)
        if any(p in _recent for p in run):
            continue
        if all(_port_free(p) for p in run):
            _recent.extend(run)
            return start
    raise RuntimeError(f"no run of {count} free ports found in {PORT_RANGE}")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so every `finally` stops its child processes."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def terminate(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """End a child that is still running: SIGTERM, then SIGKILL if it outlives `timeout_s`."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ManagedProcess:
    """One child process with its own log file; stop() is idempotent."""

    def __init__(self, name: str, args: Sequence[str], log_path: Path) -> None:
        self.name = name
        self.args = list(args)
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        hook = _pdeathsig_hook()
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self.args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=hook,
            )
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def exited(self) -> int | None:
        """The exit code if the process has ended, else None."""
        return self._proc.poll() if self._proc is not None else None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # its own group: the child and anything it forked
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=STOP_TIMEOUT_S)


def wait_ready(
    proc: ManagedProcess, urls: Sequence[str], timeout_s: float = START_TIMEOUT_S
) -> None:
    """Poll every URL until each answers 200; fail early, with the log, if the process exits."""
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
        while pending:
            code = proc.exited()
            if code is not None:
                raise RuntimeError(
                    f"{proc.name} exited with {code} before it was ready; its log "
                    f"({proc.log_path}) ends with:\n{proc.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{proc.name} not ready after {timeout_s:.0f} s (waiting for {pending[0]}); "
                    f"see {proc.log_path}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(pending[0]).status_code == 200:
                    pending.pop(0)
                    continue
            time.sleep(POLL_INTERVAL_S)


@dataclass(frozen=True)
class SimFleetSettings:
    replicas: int
    hbm_capacity_tokens: int
    time_factor: float
    cpu_capacity_tokens: int = 0
    itl_ms: float | None = None  # None: the simulator's default


@dataclass
class SimFleet:
    proc: ManagedProcess
    urls: list[str]

    def reset_caches(self) -> None:
        """POST /reset_prefix_cache on every replica (vLLM's endpoint for a cold start)."""
        with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
            for url in self.urls:
                client.post(f"{url}/reset_prefix_cache").raise_for_status()


@contextlib.contextmanager
def sim_fleet(
    settings: SimFleetSettings, log_dir: Path, port: int | None = None
) -> Iterator[SimFleet]:
    """`python -m loadtest.sim` on consecutive ports from `port` (None: free ones), ready on
    exit from the with-statement."""
    port = free_port_run(settings.replicas) if port is None else port
    args = [
        sys.executable, "-m", "loadtest.sim",
        "--replicas", str(settings.replicas),
        "--port", str(port),
        "--hbm-capacity-tokens", str(settings.hbm_capacity_tokens),
        "--cpu-capacity-tokens", str(settings.cpu_capacity_tokens),
        "--time-factor", str(settings.time_factor),
    ]  # fmt: skip
    if settings.itl_ms is not None:
        args += ["--itl-ms", str(settings.itl_ms)]
    proc = ManagedProcess("sim fleet", args, log_dir / "sim.log")
    urls = [f"http://127.0.0.1:{port + i}" for i in range(settings.replicas)]
    try:
        proc.start()
        wait_ready(proc, [f"{u}/health" for u in urls])
        yield SimFleet(proc, urls)
    finally:
        proc.stop()


@dataclass
class GatewayProc:
    proc: ManagedProcess
    url: str


@contextlib.contextmanager
def gateway(
    replica_urls: Sequence[str],
    policy: str,
    log_dir: Path,
    *,
    pool: dict[str, Any] | None = None,
    port: int | None = None,
) -> Iterator[GatewayProc]:
    """`python -m gateway serve --config FILE` on `port` (None: a free one), ready (/ready is
    200). The config is written next to the logs: one pool of `replica_urls`, with `pool`'s
    extra keys (the fleet's capacities, as an operator would configure them)."""
    config = {
        "routing": {"policy": policy},
        "pools": [{"name": "default", "replicas": list(replica_urls), **(pool or {})}],
    }
    with gateway_from_config(config, log_dir, policy, port=port) as gw:
        yield gw


def loopback_urls(count: int) -> list[str]:
    """`count` loopback base URLs on consecutive ports that were free a moment ago."""
    port = free_port_run(count)
    return [f"http://127.0.0.1:{port + i}" for i in range(count)]


@contextlib.contextmanager
def sim_from_config(
    config: dict[str, Any], log_dir: Path, name: str, engine_args: Sequence[str] = ()
) -> Iterator[ManagedProcess]:
    """`python -m loadtest.sim --config FILE`: every loopback replica and remote tier of a gateway
    config, with its capacities and costs; ready (every /health is 200) on entry. `engine_args`:
    the sim's engine flags for every replica (--engine-model, --max-num-batched-tokens, ...);
    none: vLLM V1's step loop with vLLM's defaults scaled (loadtest/sim/steps.py)."""
    config_path = log_dir / f"sim-{name}.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    args = [sys.executable, "-m", "loadtest.sim", "--config", str(config_path), *engine_args]
    proc = ManagedProcess(f"sim fleet ({name})", args, log_dir / f"sim-{name}.log")
    urls = [u for pool in config["pools"] for u in pool["replicas"]]
    urls += [t["url"] for t in config.get("remote_tiers", []) if t.get("url")]
    try:
        proc.start()
        wait_ready(proc, [f"{u}/health" for u in urls])
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def gateway_from_config(
    config: dict[str, Any], log_dir: Path, name: str, *, port: int | None = None
) -> Iterator[GatewayProc]:
    """`python -m gateway serve --config FILE` with a whole config (its `listen` is set to
    `port` on loopback, or a free port), ready (/ready is 200) on entry."""
    port = free_port() if port is None else port
    config = {**config, "listen": {"host": "127.0.0.1", "port": port}}
    if not config.get("tenants") and not config.get("admin") and "auth" not in config:
        config["auth"] = {"mode": "open"}  # a benchmark without tenants: no keys to check
    config_path = log_dir / f"gateway-{name}.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    args = [
        sys.executable, "-m", "gateway", "serve",
        "--config", str(config_path),
        "--log-level", "warning",
    ]  # fmt: skip
    proc = ManagedProcess(f"gateway ({name})", args, log_dir / f"gateway-{name}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        proc.start()
        wait_ready(proc, [f"{url}/ready"])
        yield GatewayProc(proc, url)
    finally:
        proc.stop()
