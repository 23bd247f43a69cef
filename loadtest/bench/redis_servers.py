"""Throwaway redis-server processes on loopback, for tests and benchmarks.

`RedisServer` starts one standalone server; `RedisClusterProcs` starts three masters and joins
them with `redis-cli --cluster create`. Each process gets its own temporary directory, no
persistence, and is stopped with terminate + wait. Nothing here touches a shared server.

A standalone server can be secured as a deployment would: `password` (requirepass), `users`
(ACL users with their passwords and rules; `url` then logs in as the first one) and `tls` (a
TLS-only port with a CA and server certificate made here with openssl; `url` is rediss:// with
the CA file in `ssl_ca_certs`). `restart()` stops it and starts it again empty, on the same port
with the same credentials, as a Redis without persistence comes back.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Self
from urllib.parse import quote

from loadtest.bench.processes import free_port, terminate

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


class _Throwaway:
    """Started on entering a `with`, stopped (and removed) on leaving it."""

    def start(self) -> object:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _wait_until(what: str, timeout_s: float, predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(POLL_INTERVAL_S)
    raise RuntimeError(f"timed out after {timeout_s} s waiting for {what}")


class RedisServer(_Throwaway):
    """One redis-server on 127.0.0.1:<port>; use as a context manager or call start()/stop()."""

    def __init__(
        self,
        *,
        cluster: bool = False,
        password: str | None = None,
        users: dict[str, tuple[str, str]] | None = None,
        tls: bool = False,
    ) -> None:
        """`users`: name -> (password, ACL rules), e.g. {"gw": ("pw", "~cl:* +@all")}."""
        if cluster and (password or users or tls):
            raise ValueError("credentials and TLS are for a standalone server")
        self.port = free_port()
        self.password = password
        self.users = dict(users or {})
        self.tls = tls
        self._cluster = cluster
        self._dir = Path()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The URL a client connects with: credentials and, with TLS, the CA to trust."""
        auth = ""
        if self.users:
            name, (password, _rules) = next(iter(self.users.items()))
            auth = f"{quote(name, safe='')}:{quote(password, safe='')}@"
        elif self.password:
            auth = f":{quote(self.password, safe='')}@"
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.ca_file}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def ca_file(self) -> Path:
        return self._dir / "ca.pem"

    def start(self) -> RedisServer:
        self._dir = Path(tempfile.mkdtemp(prefix=f"cachelane-redis-{self.port}-"))
        if self.tls:
            make_tls_files(self._dir)
        return self._launch()

    def restart(self) -> RedisServer:
        """Stop and start again, empty (no persistence), same port, credentials and certificates."""
        self._terminate()
        return self._launch()

    def _launch(self) -> RedisServer:
        port = (
            ["--port", "0", "--tls-port", str(self.port)]
            if self.tls
            else ["--port", str(self.port)]
        )
        args = [
            _binary("redis-server"),
            *port,
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._dir),
        ]  # fmt: skip
        if self.tls:
            args += [
                "--tls-cert-file", str(self._dir / "server.pem"),
                "--tls-key-file", str(self._dir / "server.key"),
                "--tls-ca-cert-file", str(self.ca_file),
                "--tls-auth-clients", "no",
            ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        if self.users:  # the ACL users only: no password-less default user
            args += ["--user", "default", "off"]
        for name, (password, rules) in self.users.items():
            args += ["--user", name, "on", f">{password}", *rules.split()]
        if self._cluster:
            conf = self._dir / f"nodes-{self.port}.conf"
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(conf)]
            # The bus defaults to port + 10000, which overflows for high ephemeral ports.
            args += ["--cluster-port", str(free_port())]
        log = (self._dir / "redis.log").open("ab")
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        _wait_until(f"PING on port {self.port}", START_TIMEOUT_S, self._pings)
        return self

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """redis-cli against this server, logged in, over TLS when it has TLS."""
        login: list[str] = []
        if self.users:
            name, (password, _rules) = next(iter(self.users.items()))
            login = ["--user", name, "--pass", password, "--no-auth-warning"]
        elif self.password:
            login = ["-a", self.password, "--no-auth-warning"]
        if self.tls:
            login += ["--tls", "--cacert", str(self.ca_file)]
        return _cli(self.port, *login, *args)

    def _pings(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            log = (self._dir / "redis.log").read_text(errors="replace")
            raise RuntimeError(f"redis-server exited with {self._proc.returncode}:\n{log}")
        return self.cli("PING").stdout.strip() == "PONG"

    def _terminate(self) -> None:
        if self._proc is not None:
            terminate(self._proc, STOP_TIMEOUT_S)
        self._proc = None

    def stop(self) -> None:
        self._terminate()
        if self._dir != Path():
            shutil.rmtree(self._dir, ignore_errors=True)


def make_tls_files(directory: Path) -> None:
    """ca.pem, and server.pem / server.key for 127.0.0.1 signed by it (openssl, 1 day)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RedisMissing("openssl not found on PATH: it makes the test TLS certificates")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, capture_output=True, check=True, timeout=30)

    run(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=cachelane test CA",
    )  # fmt: skip
    run(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key",
        "-out", "server.csr", "-subj", "/CN=127.0.0.1",
    )  # fmt: skip
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-out", "server.pem", "-extfile", "san.ext",
    )  # fmt: skip


class RedisClusterProcs(_Throwaway):
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
