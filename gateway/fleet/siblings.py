"""One routing view for the worker processes of `cachelane serve --workers N`.

Each worker routes on its own embedded index and its own load counts, so that the decision path
stays in-process; what a worker changes in them it publishes to its siblings, which apply it to
theirs:

- a prompt recorded at a location (the index `record` after a replica accepted a request, or a
  remote-tier write), so a follow-up that lands on another worker finds the prefix;
- a reservation: its uncached tokens and load time when sent, its first byte, its end, so every
  worker sees every worker's requests in a replica's in-flight count and prefill queue.

Metrics: each worker also answers `metrics-<pid>.sock` (a Unix stream socket) with its own
exposition; the worker that serves GET /metrics merges its siblings' into its own
(`merged_metrics`): counters, histograms and summaries add up, a gauge is the largest value
(each worker's gauges describe the shared view: replicas' health, in-flight counts with the
siblings' requests in them, the index). prometheus_client's multiprocess mode cannot serve
instead: it exports no custom collector (the gauges absent until known,
gateway/telemetry/families.py; the GC pauses, gateway/telemetry/heap.py; the process and
platform collectors) and cannot remove a label's series (a replica that leaves takes its series
with it: Metrics.forget_replica), both listed among its limitations
(prometheus.github.io/client_python/multiprocess).

The channel is one Unix datagram socket per worker, `worker-<pid>.sock` in the directory the
supervisor made (WORKERS_DIR_ENV); what one turn of the event loop published leaves as one
datagram, one non-blocking sendto per sibling, in order, off the decision path. The
alternative, one process owning the index and the others asking it over a Unix socket, puts a
round trip on every decision and one event loop in every request's path; publishing costs one
send per loop turn and one receive per sibling. A datagram a sibling's full queue refuses waits
and is sent again, after nothing sent later; every second each worker also sends its live
reservations, so a sibling's counts mend whatever was lost; a sibling that is gone is forgotten
with the load it held.

With the Redis index the workers share Redis instead, and only load is published.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.fleet.replica import Joining
from routing.index import Index, MemoryIndex
from routing.types import BlockHits, Location

if TYPE_CHECKING:
    from gateway.fleet.registry import Registry
    from gateway.fleet.replica import Reservation

log = logging.getLogger("cachelane.siblings")

WORKERS_DIR_ENV = "CACHELANE_WORKERS_DIR"
METRICS_TIMEOUT_S = 2.0  # a sibling that cannot answer in this long is left out of /metrics
SEND_RETRY_S = 0.002
MAX_PENDING_DATAGRAMS = 1_000
# A Unix datagram socket queues net.unix.max_dgram_qlen datagrams (10 by default); a sibling
# that has not read them yet refuses more. What it refuses waits here, in order, and is sent
# again every SEND_RETRY_S; past MAX_PENDING_DATAGRAMS (seconds of traffic) the oldest go, and
# the next snapshot of live reservations (every REFRESH_S) puts the sibling's counts right.
REFRESH_S = 1.0  # how often the sibling list is re-read (a worker that restarted is found again)
RECV_BUFFER_BYTES = 4 * 1024 * 1024
# Room for bursts: a record of a 32k-token prompt is ~16 KiB (2,048 hashes of 8 bytes).
_FOREIGN_KEY_BIT = 1 << 62  # a sibling's reservation keys never meet this process's id()s

_RECORD, _JOIN, _FIRST_BYTE, _END, _SNAPSHOT = b"R", b"J", b"F", b"E", b"S"


class Siblings:
    """This worker's end of the channel: publish, and apply what siblings publish."""

    def __init__(
        self,
        directory: Path,
        registry: Registry,
        exposition: Callable[[], bytes],
        *,
        pid: int | None = None,  # this worker's; tests give two ends in one process two pids
    ) -> None:
        self.directory = directory
        self._registry = registry
        self._exposition = exposition  # this worker's own /metrics text
        self._pid = os.getpid() if pid is None else pid
        self._metrics_path = directory / f"metrics-{self._pid}.sock"
        self._metrics_server: asyncio.Server | None = None
        self._path = directory / f"worker-{self._pid}.sock"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER_BYTES)
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()
        self._sock.bind(str(self._path))
        self._peers: list[str] = []
        self._index: Index | None = None
        # (sibling pid, its reservation key) -> (replica name, still awaiting its first byte)
        self._shadows: dict[tuple[int, int], tuple[str, bool]] = {}
        self._outbox: list[bytes] = []
        self._pending: dict[str, deque[bytes]] = {}  # per sibling, datagrams it has not taken
        self._live: set[int] = set()  # this worker's reservations not yet ended (the snapshot)
        self.dropped = 0  # datagrams a sibling's full queue still refused after the retries
        self.received = 0

    @classmethod
    def from_env(cls, registry: Registry, exposition: Callable[[], bytes]) -> Siblings | None:
        directory = os.environ.get(WORKERS_DIR_ENV)
        return cls(Path(directory), registry, exposition) if directory else None

    def share_index(self, index: Index) -> Index:
        """`index` for this worker's routing, its records published; siblings' applied to it."""
        self._index = index
        return SharedIndex(index, self)

    def start(self) -> asyncio.Task[None]:
        """Listen (on the running loop) and return the task that keeps the sibling list."""
        asyncio.get_running_loop().add_reader(self._sock.fileno(), self._on_readable)
        self._refresh()
        return asyncio.create_task(self._run(), name="siblings")

    async def _run(self) -> None:
        async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(self._exposition())
            with contextlib.suppress(OSError):
                await writer.drain()
            writer.close()

        with contextlib.suppress(FileNotFoundError):
            self._metrics_path.unlink()
        self._metrics_server = await asyncio.start_unix_server(answer, str(self._metrics_path))
        await self._keep_peers()

    async def merged_metrics(self, own: bytes) -> bytes:
        """`own` exposition with every sibling's merged in (see the module docstring)."""
        texts = [own]
        for path in self._peers:
            metrics = path.replace("/worker-", "/metrics-")
            try:
                async with asyncio.timeout(METRICS_TIMEOUT_S):
                    reader, writer = await asyncio.open_unix_connection(metrics)
                    texts.append(await reader.read())
                    writer.close()
            except (OSError, TimeoutError) as err:
                log.warning("no metrics from sibling %s: %r", metrics, err)
        return merge_expositions(texts) if len(texts) > 1 else own

    def close(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.close()
        with contextlib.suppress(FileNotFoundError):
            self._metrics_path.unlink()
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()

    def status(self) -> dict[str, int]:
        return {
            "pid": self._pid,
            "siblings": len(self._peers),
            "received": self.received,
            "dropped": self.dropped,
            "shadow_reservations": len(self._shadows),
        }

    # -- publishing ----------------------------------------------------------------------------

    def recorded(self, model: str, hashes: Sequence[int], location: Location) -> None:
        head = orjson.dumps([model, location.key()])
        self._publish(_RECORD + head + b"\n" + array("Q", hashes).tobytes())

    def reserved(self, reservation: Reservation, joining: Joining) -> None:
        self._live.add(id(reservation))
        replica = reservation.replica.name
        self._publish(_JOIN + orjson.dumps([replica, id(reservation), *joining]))

    def first_byte(self, reservation: Reservation) -> None:
        self._publish(_FIRST_BYTE + orjson.dumps([reservation.replica.name, id(reservation)]))

    def released(self, reservation: Reservation) -> None:
        self._live.discard(id(reservation))
        self._publish(_END + orjson.dumps([reservation.replica.name, id(reservation)]))

    def _publish(self, message: bytes) -> None:
        """Queue a message; what one turn of the event loop queued leaves as one datagram."""
        if not self._peers:
            return
        self._outbox.append(len(message).to_bytes(4, "little") + message)
        if len(self._outbox) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        datagram = self._pid.to_bytes(4, "little") + b"".join(batch)
        for peer in self._peers:
            queue = self._pending.setdefault(peer, deque())
            queue.append(datagram)
            if len(queue) > MAX_PENDING_DATAGRAMS:
                queue.popleft()  # the sibling has not read for long: the snapshot mends this
                self.dropped += 1
            if len(queue) == 1:  # else a retry is already scheduled
                self._drain(peer)

    def _drain(self, peer: str) -> None:
        """Send `peer` what waits for it, in order (a reservation's end never overtakes its
        start); a full queue on its side is retried shortly."""
        queue = self._pending.get(peer)
        while queue:
            try:
                self._sock.sendto(queue[0], peer)
            except BlockingIOError:  # the sibling is busy: its socket's queue is full
                asyncio.get_running_loop().call_later(SEND_RETRY_S, self._drain, peer)
                return
            except OSError as err:  # gone: found out at the next refresh
                if err.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                    log.warning("cannot publish to sibling %s: %r", peer, err)
                queue.clear()
                return
            queue.popleft()

    # -- applying ------------------------------------------------------------------------------

    def _on_readable(self) -> None:
        while True:
            try:
                data = self._sock.recv(RECV_BUFFER_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            pid, at = int.from_bytes(data[:4], "little"), 4
            while at < len(data):
                size = int.from_bytes(data[at : at + 4], "little")
                message = data[at + 4 : at + 4 + size]
                at += 4 + size
                self.received += 1
                try:
                    self._apply(pid, message[:1], message[1:])
                except Exception:  # a message this version cannot read must not stop the others
                    log.exception("cannot apply a sibling's message")

    def _apply(self, pid: int, kind: bytes, body: bytes) -> None:
        if kind == _RECORD:
            head, _, raw = body.partition(b"\n")
            model, key = orjson.loads(head)
            hashes = array("Q")
            hashes.frombytes(raw)
            if isinstance(self._index, MemoryIndex):
                self._index.record_now(model, hashes.tolist(), Location.parse(key))
            return
        if kind == _SNAPSHOT:  # the sender's live reservations: any other shadow of it is stale
            live = set(orjson.loads(body))
            for key in [k for k in self._shadows if k[0] == pid and k[1] not in live]:
                self._prefill_done(*key, self._shadows[key])
                self._end(*key)
            return
        if kind == _JOIN:
            name, rid, at_s, tokens, swaps, priority = orjson.loads(body)
            replica = self._registry.replicas.get(name)
            if replica is None:
                return
            if not replica.awaiting_first_byte:
                replica.head_since_s = time.perf_counter()
            replica.in_flight += 1
            replica.joining[self._key(pid, rid)] = Joining(at_s, tokens, bool(swaps), priority)
            self._shadows[(pid, rid)] = (name, True)
            self._registry.on_load_change()
            return
        name, rid = orjson.loads(body)
        shadow = self._shadows.get((pid, rid))
        if shadow is None:
            return
        self._prefill_done(pid, rid, shadow)
        if kind == _END:
            self._end(pid, rid)
        self._registry.on_load_change()

    def _prefill_done(self, pid: int, rid: int, shadow: tuple[str, bool]) -> None:
        name, joining = shadow
        if not joining:
            return
        self._shadows[(pid, rid)] = (name, False)
        replica = self._registry.replicas.get(name)
        if replica is not None and replica.joining.pop(self._key(pid, rid), None) is not None:
            replica.head_since_s = time.perf_counter()

    def _end(self, pid: int, rid: int) -> None:
        name, _ = self._shadows.pop((pid, rid))
        replica = self._registry.replicas.get(name)
        if replica is not None:
            replica.in_flight -= 1

    @staticmethod
    def _key(pid: int, rid: int) -> int:
        return -(_FOREIGN_KEY_BIT | (pid << 48) | (rid & ((1 << 48) - 1)))

    # -- the sibling list ----------------------------------------------------------------------

    def reload_siblings(self) -> int:
        """SIGHUP to every sibling: each reloads the config file in place, as this worker just
        did (POST /admin/reload reaches one worker). Returns how many were told."""
        told = 0
        for path in self._peers:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(Path(path).stem.removeprefix("worker-")), signal.SIGHUP)
                told += 1
        return told

    async def _keep_peers(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            self._refresh()
            self._publish(_SNAPSHOT + orjson.dumps(sorted(self._live)))

    def _refresh(self) -> None:
        peers, alive = [], {self._pid}
        for path in sorted(self.directory.glob("worker-*.sock")):
            pid = int(path.stem.removeprefix("worker-"))
            if pid == self._pid:
                continue
            if not pid_alive(pid):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            alive.add(pid)
            peers.append(str(path))
        self._peers = peers
        for pid, rid in [k for k in self._shadows if k[0] not in alive]:  # a sibling died
            self._prefill_done(pid, rid, self._shadows[(pid, rid)])
            self._end(pid, rid)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (a sibling worker that has not died)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedIndex:
    """An Index whose records are also published to the sibling workers."""

    def __init__(self, inner: Index, siblings: Siblings) -> None:
        self.inner = inner
        self._siblings = siblings

    async def lookup(self, model: str, hashes: Sequence[int]) -> BlockHits:
        return await self.inner.lookup(model, hashes)

    async def record(self, model: str, hashes: Sequence[int], location: Location) -> None:
        await self.inner.record(model, hashes, location)
        self._siblings.recorded(model, hashes, location)

    async def evict(self, model: str, hashes: Sequence[int], location: Location) -> None:
        await self.inner.evict(model, hashes, location)

    async def drop_location(self, location: Location) -> None:
        await self.inner.drop_location(location)

    async def drop_replica(self, replica: str) -> None:
        await self.inner.drop_replica(replica)

    async def close(self) -> None:
        await self.inner.close()


def merge_expositions(texts: Sequence[bytes]) -> bytes:
    """Prometheus text expositions of the same metrics merged into one: samples with the same
    name and labels add up, except a gauge's, whose largest value is kept."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            into = values.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in into:
                    into[key] = sample.value
                elif merged.type == "gauge":
                    into[key] = max(into[key], sample.value)
                else:
                    into[key] += sample.value
    for name, merged in families.items():
        merged.samples = [
            Sample(sample_name, dict(labels), value)
            for (sample_name, labels), value in values[name].items()
        ]

    class _Merged:
        def collect(self) -> Iterator[Metric]:
            return iter(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)
