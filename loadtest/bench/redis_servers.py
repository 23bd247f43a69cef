"""Throwaway redis-server processes on loopback, for tests and benchmarks.

`RedisServer` starts one standalone server; `RedisClusterProcs` starts three masters and joins
them with `redis-cli --cluster create`. Each process gets its own temporary directory, no
persistence, and is stopped with terminate + wait. Nothing here touches a shared server.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from loadtest.bench.processes import free_port

START_TIMEOUT_S = 10.0  # a cold redis-server answers PING in ~10 ms; 10 s covers a loaded CI box
CLUSTER_OK_TIMEOUT_S = 20.0  # cluster_state:ok follows slot assignment within ~1-2 s locally
STOP_TIMEOUT_S = 5.0  # SIGTERM shutdown of a no-persistence server is near-instant
POLL_INTERVAL_S = 0.02
CLUSTER_MASTERS = 3  # the smallest cluster redis-cli --cluster create accepts

MISSING_MESSAGE = (
    "redis-server / redis-cli not found on PATH. The Redis tests and benchmarks start a real "
    "throwaway server; `make test` installs it (apt-get install -y redis-server)."
)


class RedisMissing(RuntimeError):
    pass


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RedisMissing(MISSING_MESSAGE)
    return path


def _cli(port: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_binary("redis-cli"), "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
        check=False,
    )


def _wait_until(what: str, timeout_s: float, predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(POLL_INTERVAL_S)
    raise RuntimeError(f"timed out after {timeout_s} s waiting for {what}")


class RedisServer:
    """One redis-server on 127.0.0.1:<port>; use as a context manager or call start()/stop()."""

    def __init__(self, *, cluster: bool = False) -> None:
        self.port = free_port()
        self._cluster = cluster
        self._dir = Path()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self._dir = Path(tempfile.mkdtemp(prefix=f"cachelane-redis-{self.port}-"))
        args = [
            _binary("redis-server"),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._dir),
        ]  # fmt: skip
        if self._cluster:
            conf = self._dir / f"nodes-{self.port}.conf"
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(conf)]
            # The bus defaults to port + 10000, which overflows for high ephemeral ports.
            args += ["--cluster-port", str(free_port())]
        log = (self._dir / "redis.log").open("wb")
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        _wait_until(f"PING on port {self.port}", START_TIMEOUT_S, self._pings)
        return self

    def _pings(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            log = (self._dir / "redis.log").read_text(errors="replace")
            raise RuntimeError(f"redis-server exited with {self._proc.returncode}:\n{log}")
        return _cli(self.port, "PING").stdout.strip() == "PONG"

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._dir != Path():
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class RedisClusterProcs:
    """A 3-master Redis Cluster on loopback, no replicas."""

    def __init__(self) -> None:
        self.nodes = [RedisServer(cluster=True) for _ in range(CLUSTER_MASTERS)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisClusterProcs:
        try:
            for node in self.nodes:
                node.start()
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            replicas = ["--cluster-replicas", "0", "--cluster-yes"]
            created = subprocess.run(
                [_binary("redis-cli"), "--cluster", "create", *addresses, *replicas],
                capture_output=True,
                text=True,
                timeout=CLUSTER_OK_TIMEOUT_S,
                check=False,
            )
            if created.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout}")
            _wait_until("cluster_state:ok", CLUSTER_OK_TIMEOUT_S, self._ok)
        except BaseException:
            self.stop()
            raise
        return self

    def _ok(self) -> bool:
        return all("cluster_state:ok" in _cli(n.port, "CLUSTER", "INFO").stdout for n in self.nodes)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisClusterProcs:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
