"""A throwaway dnsmasq on a free loopback port, authoritative for one test domain.

Its A records come from a hosts file (`set_hosts` rewrites it and sends SIGHUP, which makes
dnsmasq read it again); its SRV records are command-line options, so `set_srv` restarts it on the
same port. Names it does not know in the domain answer NXDOMAIN (`--local`), never a forward.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import dns.exception
import dns.message
import dns.query

from tests.helpers.ports import free_port

MISSING_MESSAGE = (
    "dnsmasq not found on PATH. The discovery tests start a real throwaway DNS server; "
    "`make test` installs it (apt-get install -y dnsmasq-base)."
)
START_TIMEOUT_S = 10.0  # dnsmasq answers within milliseconds; room for a loaded machine
STOP_TIMEOUT_S = 5.0
POLL_S = 0.02

Srv = tuple[str, str, int]  # (SRV name, target name, port)


class DnsmasqMissing(RuntimeError):
    pass


class Dnsmasq:
    def __init__(self, workdir: Path, *, domain: str = "test") -> None:
        binary = shutil.which("dnsmasq") or next(
            (p for p in ("/usr/sbin/dnsmasq", "/sbin/dnsmasq") if Path(p).exists()), None
        )
        if binary is None:
            raise DnsmasqMissing(MISSING_MESSAGE)
        self._binary = binary
        self._hosts = workdir / "hosts"
        self._hosts.write_text("")
        self._domain = domain
        self._srv: list[Srv] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self.port = _free_udp_and_tcp_port()

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, hosts: Mapping[str, Sequence[str]], srv: Sequence[Srv] = ()) -> Dnsmasq:
        """`hosts`: name -> its addresses; `srv`: the SRV records."""
        self._write_hosts(hosts)
        self._srv = list(srv)
        self._launch()
        return self

    def set_hosts(self, hosts: Mapping[str, Sequence[str]]) -> None:
        """Replace the A/AAAA records; dnsmasq re-reads them on SIGHUP."""
        assert self._proc is not None
        self._write_hosts(hosts)
        self._proc.send_signal(signal.SIGHUP)
        probe = next(iter(hosts), None)
        if probe is not None:  # re-read: the first name answers with its new addresses
            self._wait_for(probe, "A", {a for a in hosts[probe] if ":" not in a})

    def set_srv(self, srv: Sequence[Srv]) -> None:
        """Replace the SRV records: dnsmasq takes them from its command line, so it restarts."""
        self.stop()
        self._srv = list(srv)
        self._launch()

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def _write_hosts(self, hosts: Mapping[str, Sequence[str]]) -> None:
        lines = [f"{address} {name}" for name, addresses in hosts.items() for address in addresses]
        self._hosts.write_text("".join(line + "\n" for line in lines))

    def _launch(self) -> None:
        args = [
            self._binary,
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--no-poll",
            "--pid-file=",  # no pid file, and no system service is touched
            "--bind-interfaces",
            "--listen-address=127.0.0.1",
            f"--port={self.port}",
            f"--addn-hosts={self._hosts}",
            f"--local=/{self._domain}/",  # authoritative: unknown names are NXDOMAIN
            "--log-facility=/dev/null",
            *[f"--srv-host={name},{target},{port}" for name, target, port in self._srv],
        ]
        if os.geteuid() == 0:  # as root it would drop to nobody, who cannot read the hosts file
            args.append("--user=root")
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_for(f"nothing-here.{self._domain}", "A", None)

    def _wait_for(self, name: str, rdtype: str, addresses: set[str] | None) -> None:
        """Until the server answers `name` (with exactly `addresses`, when given)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                raise RuntimeError(f"dnsmasq exited with {self._proc.returncode}: {err}")
            try:
                reply = dns.query.udp(
                    dns.message.make_query(name, rdtype), "127.0.0.1", timeout=0.2, port=self.port
                )
            except (dns.exception.Timeout, OSError):
                time.sleep(POLL_S)
                continue
            got = {rr.address for rrset in reply.answer for rr in rrset}
            if addresses is None or got == addresses:
                return
            time.sleep(POLL_S)
        raise RuntimeError(f"dnsmasq on port {self.port} did not answer {name} in time")


def _free_udp_and_tcp_port() -> int:
    """A loopback port free for both UDP and TCP a moment ago (dnsmasq binds both)."""
    for _ in range(50):
        port = free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no loopback port free for both UDP and TCP")
