"""Soak: minutes of steady traffic through a gateway with the Redis index in front of simulated
replicas, while replicas crash and restart, Redis restarts, and some clients read slowly or leave.

    python -m loadtest.bench.soak                   # 10 minutes at 10 requests/s
    python -m loadtest.bench.soak --minutes 0.6 --rate 8   # the CI version (tests/integration)

What runs (every process on loopback, started and stopped here): three replicas, each its own
`python -m loadtest.sim` process so that one can be killed; a throwaway redis-server
(loadtest/bench/redis_servers.py); one `cachelane serve` with `index.backend: redis` and keys
checked: a tenant from the config file and one added through the admin API at the start (its
record lives in Redis), each sending half the requests. Requests arrive as a Poisson process at
`--rate`, on prompts that share one of a few system prompts (so the index matters); the mix
(CLIENT_MIX): streamed, whole, slow readers (a pause between chunks, long answers) and
abandoners (they leave after a random delay, before or during the answer).

Faults, at fixed fractions of the run (FAULTS): sim-0 crashes (SIGKILL) and comes back; Redis
stops and comes back (empty: no persistence, so the admin-added tenant must be re-written by the
gateway); sim-1 is stopped gracefully (SIGTERM, a rolling restart) and comes back.

A failed request is any non-200 answer, an error event inside a stream, a stream that ends
without `[DONE]`, a transport error or a client timeout; an abandoner fails only if it saw one of
these before it left. The faults may cause exactly one kind (ALLOWED_KIND): a stream that was
being answered by sim-0 when it was killed (the replica died mid-answer; nothing before the first
byte can mend that, and the gateway ends such a stream with an error event). Everything else
must be zero: a crashed or restarting replica is covered by the retry before the first byte
(and the health check's ejection), a Redis outage by the local view of the index and of the
tenants, a Redis that lost its data by the gateway writing back what it knows.

Reported (a table, results/bench_soak.json, results/bench_soak.png): requests and failures by
kind (allowed and not), the gateway's RSS over time (sampled from /proc every RSS_SAMPLE_S; the
slope after warm-up and after the last fault, in MiB per minute, and the growth from warm-up's
end to the run's end), TTFT p50/p99 of the streamed clients and the prefix hit rate (the
engines' usage), overall and per window; the gateway's retries, ejections, clients gone and
index errors (its /metrics), its in-flight count once every client is done, and the tracebacks
and ERROR lines in its log. Exit code 1 when any failure is not allowed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from loadtest.bench import figures
from loadtest.bench.processes import (
    ManagedProcess,
    gateway_from_config,
    loopback_urls,
    wait_ready,
)
from loadtest.bench.redis_servers import RedisServer
from loadtest.bench.report import write_json
from loadtest.sim.config import SIM_MODEL
from routing.whatif.summary import percentile

DEFAULT_MINUTES = 10.0
DEFAULT_RATE = 10.0  # requests/s: a few in flight per replica (8-48 tokens at the sim's 10 ms each)
REPLICAS = 3
FAMILIES = 8  # system prompts shared by the requests (prefix reuse for the index to track)
SYSTEM_WORDS = 300  # ~300-400 tokens: some 20 16-token blocks per system prompt to match
CLIENT_MIX = {"stream": 0.55, "whole": 0.15, "slow_reader": 0.15, "abandon": 0.15}
SLOW_READ_PAUSE_S = 0.05  # a slow reader's pause between chunks: 48 tokens take ~2.4 s to read
SLOW_MAX_TOKENS = 48
MAX_TOKENS = (8, 32)  # other clients' answer lengths, uniform
ABANDON_AFTER_S = (0.0, 0.4)  # uniform: some leave before the first byte, some mid-stream
CLIENT_TIMEOUT_S = 60.0  # one request, start to end; no answer here takes more than a few s
DRAIN_TIMEOUT_S = 90.0  # after the last arrival, requests still open get this long
RSS_SAMPLE_S = 1.0  # once a second: the slope of a 10-minute run is fitted on ~600 points
WARMUP_FRACTION = 0.2  # RSS slope and growth are measured after this share of the run
LAST_QUARTER = 0.75  # and the slope again after the last fault (FAULTS): is it flat by then?
WINDOWS = 20  # TTFT p99 and RSS are also shown per window of the run
SETTLE_S = 5.0  # after the last client, the gateway's in-flight count must reach 0 within this
INDEX_TTL_S = 60.0
# The index's entries live 600 s by default (routing/index.py), so for a 10-minute run the
# gateway's local view grows by design: every request's own last block is new. At 60 s the
# index reaches its steady state (entries expire as fast as they come) within the warm-up, and
# what RSS still does after it is the gateway's own.
REDIS_DOWN_S = 3.0  # at least; shorter runs keep Redis down for 5% of the run

# (fraction of the run, action): crash and graceful stop hit different replicas
FAULTS = (
    (0.20, "crash sim-0"),
    (0.30, "restart sim-0"),
    (0.45, "stop redis"),
    (0.50, "start redis"),
    (0.65, "graceful stop sim-1"),
    (0.75, "restart sim-1"),
)
CRASHED = "sim-0"
ADMIN_TENANT = "from-admin-api"  # added through the admin API: its record lives in Redis
ALLOWED_KIND = "stream_cut_by_crash"

REPLICA_HEADER = "x-cachelane-replica"
GATEWAY_COUNTERS = {  # read from the gateway's /metrics at the end: how it handled the faults
    "upstream_retries": "cachelane_upstream_retries_total",
    "replica_ejections": "cachelane_replica_ejections_total",
    "client_gone": "cachelane_client_gone_total",
    "index_errors": "cachelane_index_errors_total",
}


@dataclass
class Outcome:
    kind: str  # the client: stream, whole, slow_reader, abandon
    started_s: float  # since the run began
    ended_s: float = math.nan
    status: int | None = None
    replica: str | None = None  # host:port, from the gateway's header
    ttft_s: float | None = None
    failure: str | None = None  # None: it succeeded (or an abandoner left cleanly)
    abandoned: bool = False
    tenant: str = ""
    prompt_tokens: int | None = None  # the engine's usage
    cached_tokens: int | None = None


@dataclass
class Run:
    minutes: float
    rate: float
    seed: int
    t0: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    rss: list[tuple[float, float]] = field(default_factory=list)  # (s, MiB)
    fds: list[tuple[float, int]] = field(default_factory=list)  # (s, open file descriptors)
    faults: list[tuple[float, str]] = field(default_factory=list)  # (s, what) as done
    gateway: dict[str, float] = field(default_factory=dict)  # GATEWAY_COUNTERS' totals
    in_flight_after: int | None = None  # requests the gateway still counts once all have ended
    logged: dict[str, int] = field(default_factory=dict)  # the gateway log's tracebacks, errors

    def now(self) -> float:
        return time.monotonic() - self.t0


def prompts(rng: random.Random) -> list[str]:
    words = ["cache", "route", "token", "prefix", "replica", "block", "engine", "queue"]
    return [
        f"System prompt {i}. " + " ".join(rng.choice(words) for _ in range(SYSTEM_WORDS))
        for i in range(FAMILIES)
    ]


@dataclass(frozen=True)
class Keys:
    """Random keys for this run: the tenants' and the admin's, and the records' HMAC secret."""

    secret: str = field(default_factory=lambda: secrets.token_hex(32))
    admin: str = field(default_factory=lambda: secrets.token_hex(32))
    file_tenant: str = field(default_factory=lambda: secrets.token_hex(32))
    admin_tenant: str = field(default_factory=lambda: secrets.token_hex(32))

    def config(self) -> dict[str, Any]:
        return {
            "auth": {"mode": "keys", "secret": self.secret},
            "admin": {"api_key": self.admin},
            "tenants": [{"name": "from-file", "api_key": self.file_tenant}],
        }


async def add_admin_tenant(url: str, keys: Keys) -> None:
    async with httpx.AsyncClient(timeout=10.0) as client:
        resp = await client.put(
            f"{url}/admin/tenants/{ADMIN_TENANT}",
            json={"api_key": keys.admin_tenant},
            headers={"authorization": f"Bearer {keys.admin}"},
        )
        resp.raise_for_status()


def body(rng: random.Random, systems: list[str], stream: bool, max_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": SIM_MODEL,
        "messages": [
            {"role": "system", "content": rng.choice(systems)},
            {"role": "user", "content": f"question {rng.randrange(10**9)}"},
        ],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


async def read_stream(resp: httpx.Response, out: Outcome, run: Run, pause_s: float) -> None:
    """Read the events up to `data: [DONE]`, pausing `pause_s` after each (a slow reader)."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            out.failure = f"stream_error:{chunk['error'].get('code')}"
            return
        if out.ttft_s is None and chunk.get("choices"):
            out.ttft_s = run.now() - out.started_s
        note_usage(out, chunk.get("usage"))
        if pause_s:
            await asyncio.sleep(pause_s)
    out.failure = "incomplete"


async def request(
    client: httpx.AsyncClient,
    run: Run,
    out: Outcome,
    payload: dict[str, Any],
    pause_s: float,
    key: str,
) -> None:
    headers = {"authorization": f"Bearer {key}"}
    async with client.stream("POST", "/v1/chat/completions", json=payload, headers=headers) as resp:
        out.status = resp.status_code
        out.replica = resp.headers.get(REPLICA_HEADER)
        if resp.status_code != 200:
            await resp.aread()
            out.failure = f"http_{resp.status_code}"
            return
        if payload["stream"]:
            await read_stream(resp, out, run, pause_s)
            return
        data = await resp.aread()
        if b'"choices"' not in data:
            out.failure = "bad_body"
            return
        note_usage(out, json.loads(data).get("usage"))


def note_usage(out: Outcome, usage: Any) -> None:
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        out.prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        out.cached_tokens = int(details.get("cached_tokens") or 0)


async def one(
    client: httpx.AsyncClient, run: Run, rng: random.Random, systems: list[str], keys: Keys
) -> None:
    kind = rng.choices(list(CLIENT_MIX), weights=list(CLIENT_MIX.values()))[0]
    tenant, key = (
        ("from-file", keys.file_tenant) if rng.random() < 0.5 else (ADMIN_TENANT, keys.admin_tenant)
    )
    out = Outcome(kind, run.now(), tenant=tenant)
    run.outcomes.append(out)
    stream = kind != "whole" and not (kind == "abandon" and rng.random() < 0.3)
    max_tokens = SLOW_MAX_TOKENS if kind == "slow_reader" else rng.randint(*MAX_TOKENS)
    payload = body(rng, systems, stream, max_tokens)
    pause_s = SLOW_READ_PAUSE_S if kind == "slow_reader" else 0.0
    limit_s = rng.uniform(*ABANDON_AFTER_S) if kind == "abandon" else CLIENT_TIMEOUT_S
    try:
        async with asyncio.timeout(limit_s):
            await request(client, run, out, payload, pause_s, key)
    except TimeoutError:
        if kind == "abandon":
            out.abandoned = True  # it left: the connection is closed under the gateway
        else:
            out.failure = "timeout"
    except httpx.HTTPError as err:
        out.failure = f"transport:{type(err).__name__}"
    finally:
        out.ended_s = run.now()


async def drive(gateway_url: str, run: Run, duration_s: float, keys: Keys) -> None:
    """Poisson arrivals at run.rate for duration_s, then wait (bounded) for the open ones."""
    rng = random.Random(run.seed)
    systems = prompts(rng)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(CLIENT_TIMEOUT_S)
    tasks: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(base_url=gateway_url, limits=limits, timeout=timeout) as client:
        next_s = 0.0
        bound = 2 * round(run.rate * duration_s) + 10  # Poisson: far above any real count
        for _ in range(bound):
            next_s += rng.expovariate(run.rate)
            if next_s >= duration_s:
                break
            await asyncio.sleep(max(0.0, next_s - run.now()))
            task = asyncio.create_task(one(client, run, rng, systems, keys))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(set(tasks), timeout=DRAIN_TIMEOUT_S)
        for task in tasks:
            task.cancel()


async def sample_rss(pid: int, run: Run, stop: asyncio.Event) -> None:
    while not stop.is_set():
        mib = rss_mib(pid)
        if mib is not None:
            run.rss.append((run.now(), mib))
        with contextlib.suppress(OSError):  # open sockets and files: a leaked connection shows
            run.fds.append((run.now(), len(os.listdir(f"/proc/{pid}/fd"))))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), RSS_SAMPLE_S)


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def gateway_counters(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(timeout=10.0) as client:
        text = (await client.get(f"{url}/metrics")).text
    totals = dict.fromkeys(GATEWAY_COUNTERS, 0.0)
    names = {sample: key for key, sample in GATEWAY_COUNTERS.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                totals[names[sample.name]] += sample.value
    return totals


def logged_problems(path: Path) -> dict[str, int]:
    """Tracebacks (an exception nothing handled) and ERROR lines in the gateway's log; warnings
    (an ejection, a failed index call served locally) are what the faults should cause."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    return {
        "tracebacks": sum(1 for line in lines if line.startswith("Traceback")),
        "error_lines": sum(1 for line in lines if " ERROR " in line or " CRITICAL " in line),
    }


async def settled_in_flight(url: str) -> int:
    """The gateway's in-flight count over all replicas (/ready) once every client is done: 0
    unless a request that ended (abandoned, cut, failed) kept its reservation. Polled for up to
    SETTLE_S, as the last streams' releases may trail their clients by a moment."""
    deadline = time.monotonic() + SETTLE_S
    async with httpx.AsyncClient(timeout=10.0) as client:
        while True:
            replicas = (await client.get(f"{url}/ready")).json()["replicas"].values()
            count = sum(int(r["in_flight"]) for r in replicas)
            if count == 0 or time.monotonic() > deadline:
                return count
            await asyncio.sleep(0.1)


class Replicas:
    """One `python -m loadtest.sim` process per replica, so each can be killed on its own."""

    def __init__(self, log_dir: Path) -> None:
        self.urls = loopback_urls(REPLICAS)
        self._log_dir = log_dir
        self._procs: dict[str, ManagedProcess] = {}

    def name(self, i: int) -> str:
        return f"sim-{i}"

    def start(self, i: int) -> None:
        port = self.urls[i].rsplit(":", 1)[1]
        args = [sys.executable, "-m", "loadtest.sim", "--replicas", "1", "--port", port]
        name = self.name(i)
        proc = ManagedProcess(name, args, self._log_dir / f"{name}.log").start()
        self._procs[name] = proc
        wait_ready(proc, [f"{self.urls[i]}/health"])

    def crash(self, i: int) -> None:
        proc = self._procs[self.name(i)]
        if proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.stop()  # reaps it

    def stop(self, i: int) -> None:
        self._procs[self.name(i)].stop()

    def stop_all(self) -> None:
        for proc in self._procs.values():
            proc.stop()


async def inject_faults(
    run: Run, duration_s: float, replicas: Replicas, redis: RedisServer, stop: asyncio.Event
) -> None:
    redis_down_s = max(REDIS_DOWN_S, 0.05 * duration_s)
    actions = {
        "crash sim-0": lambda: replicas.crash(0),
        "restart sim-0": lambda: replicas.start(0),
        "stop redis": redis.stop,
        "start redis": redis.start,
        "graceful stop sim-1": lambda: replicas.stop(1),
        "restart sim-1": lambda: replicas.start(1),
    }
    for fraction, what in FAULTS:
        at_s = fraction * duration_s
        if what == "start redis":
            at_s = max(at_s, run.faults[-1][0] + redis_down_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, at_s - run.now()))
        if stop.is_set():
            return
        run.faults.append((run.now(), what))  # before the act: a kill is "at" its signal
        await asyncio.to_thread(actions[what])


def classify(run: Run, replica_urls: list[str]) -> None:
    """Mark as allowed the streams sim-0 was answering when it was killed."""
    crashed = replica_urls[0].removeprefix("http://")
    crash_s = next(s for s, what in run.faults if what == f"crash {CRASHED}")
    for o in run.outcomes:
        cut = o.failure is not None and o.failure.startswith(("stream_error", "incomplete"))
        if cut and o.replica == crashed and o.started_s <= crash_s <= o.ended_s:
            o.failure = ALLOWED_KIND


def slope_mib_per_min(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of RSS over time."""
    if len(points) < 2:
        return math.nan
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_m = sum(m for _, m in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return math.nan
    return sum((t - mean_t) * (m - mean_m) for t, m in points) / var * 60


def summarize(run: Run, duration_s: float) -> dict[str, Any]:
    failures: dict[str, int] = {}
    for o in run.outcomes:
        if o.failure is not None:
            failures[o.failure] = failures.get(o.failure, 0) + 1
    allowed = failures.get(ALLOWED_KIND, 0)
    ttft_ms = [o.ttft_s * 1000 for o in run.outcomes if o.ttft_s is not None and not o.failure]
    warm_s = WARMUP_FRACTION * duration_s
    after = [(t, m) for t, m in run.rss if t >= warm_s]
    tail = [m for t, m in run.rss if t >= duration_s * 0.9]
    start = [m for t, m in after if t < warm_s + 0.1 * duration_s]
    window_s = duration_s / WINDOWS

    def hit_rate(outcomes: Sequence[Outcome]) -> float:
        prompt = sum(o.prompt_tokens or 0 for o in outcomes if o.cached_tokens is not None)
        cached = sum(o.cached_tokens or 0 for o in outcomes)
        return cached / prompt if prompt else math.nan

    windows = []
    for w in range(WINDOWS):
        lo, hi = w * window_s, (w + 1) * window_s
        in_window = [
            o.ttft_s * 1000
            for o in run.outcomes
            if o.ttft_s is not None and not o.failure and lo <= o.started_s < hi
        ]
        rss = [m for t, m in run.rss if lo <= t < hi]
        windows.append(
            {
                "start_s": round(lo, 1),
                "requests": sum(1 for o in run.outcomes if lo <= o.started_s < hi),
                "failed": sum(1 for o in run.outcomes if o.failure and lo <= o.started_s < hi),
                "ttft_p99_ms": percentile(in_window, 99),
                "hit_rate": hit_rate([o for o in run.outcomes if lo <= o.started_s < hi]),
                "rss_mib": max(rss) if rss else math.nan,
            }
        )
    redis_down = [s for s, what in run.faults if what.endswith("redis")]
    during_outage = (
        [o for o in run.outcomes if redis_down[0] <= o.started_s < redis_down[1]]
        if len(redis_down) == 2
        else []
    )
    return {
        "minutes": run.minutes,
        "rate_per_s": run.rate,
        "seed": run.seed,
        "requests": len(run.outcomes),
        "by_client": {k: sum(1 for o in run.outcomes if o.kind == k) for k in CLIENT_MIX},
        "abandoned": sum(1 for o in run.outcomes if o.abandoned),
        "failed": sum(failures.values()),
        "failed_allowed": allowed,
        "failed_not_allowed": sum(failures.values()) - allowed,
        "failures": failures,
        "served_during_redis_outage": sum(1 for o in during_outage if o.status == 200),
        "admin_tenant_served_after_redis_restart": sum(
            1
            for o in run.outcomes
            if len(redis_down) == 2
            and o.started_s >= redis_down[1]
            and o.tenant == ADMIN_TENANT
            and o.status == 200
        ),
        "gateway": run.gateway,
        "in_flight_after": run.in_flight_after,
        "gateway_logged": run.logged,
        "hit_rate": hit_rate(run.outcomes),  # the engines' cached / prompt tokens
        "ttft_p50_ms": percentile(ttft_ms, 50),
        "ttft_p99_ms": percentile(ttft_ms, 99),
        "rss_start_mib": run.rss[0][1] if run.rss else math.nan,
        "rss_max_mib": max((m for _, m in run.rss), default=math.nan),
        "fds_start_max_end": [
            run.fds[0][1] if run.fds else None,
            max((n for _, n in run.fds), default=None),
            run.fds[-1][1] if run.fds else None,
        ],
        "rss_slope_mib_per_min": slope_mib_per_min(after),
        "rss_slope_last_quarter_mib_per_min": slope_mib_per_min(
            [(t, m) for t, m in run.rss if t >= LAST_QUARTER * duration_s]
        ),
        "rss_growth_mib": (sum(tail) / len(tail) - sum(start) / len(start))
        if tail and start
        else math.nan,
        "faults": [{"at_s": round(s, 2), "what": what} for s, what in run.faults],
        "windows": windows,
        "rss": [[round(t, 1), round(m, 2)] for t, m in run.rss],
        "failed_samples": [asdict(o) for o in run.outcomes if o.failure][:20],
    }


def table(s: dict[str, Any]) -> Table:
    t = Table(title=f"soak: {s['minutes']:g} min at {s['rate_per_s']:g} req/s")
    t.add_column("measure")
    t.add_column("value", justify="right")
    logged = s["gateway_logged"]
    rows = [
        ("requests", f"{s['requests']:,}"),
        ("abandoned by their client", f"{s['abandoned']:,}"),
        ("failed, caused by the crash (allowed)", str(s["failed_allowed"])),
        ("failed, not allowed", str(s["failed_not_allowed"])),
        ("served while Redis was down", str(s["served_during_redis_outage"])),
        (
            "admin-added tenant served after Redis restarted empty",
            str(s["admin_tenant_served_after_redis_restart"]),
        ),
        ("gateway in-flight once all ended", str(s["in_flight_after"])),
        (
            "gateway log: tracebacks / ERROR lines",
            f"{logged.get('tracebacks', '-')} / {logged.get('error_lines', '-')}",
        ),
        ("TTFT p50 / p99 (ms)", f"{s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f}"),
        ("prefix hit rate (engines' cached / prompt tokens)", f"{s['hit_rate']:.1%}"),
        ("gateway RSS start / max (MiB)", f"{s['rss_start_mib']:.0f} / {s['rss_max_mib']:.0f}"),
        ("RSS slope after warm-up (MiB/min)", f"{s['rss_slope_mib_per_min']:+.2f}"),
        (
            "RSS slope after the last fault (MiB/min)",
            f"{s['rss_slope_last_quarter_mib_per_min']:+.2f}",
        ),
        ("RSS growth after warm-up (MiB)", f"{s['rss_growth_mib']:+.1f}"),
        ("gateway open fds start / max / end", " / ".join(map(str, s["fds_start_max_end"]))),
    ]
    rows += [(f"  failures: {kind}", str(n)) for kind, n in sorted(s["failures"].items())]
    rows += [(f"gateway: {k.replace('_', ' ')}", f"{v:g}") for k, v in s["gateway"].items()]
    for row in rows:
        t.add_row(*row)
    return t


def plot(path: Path, s: dict[str, Any]) -> None:
    plt = figures.pyplot()
    fig, (rss_ax, ttft_ax, hit_ax) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    rss_ax.plot([t for t, _ in s["rss"]], [m for _, m in s["rss"]], color="tab:blue")
    rss_ax.set_ylabel("gateway RSS (MiB)")
    rss_ax.set_ylim(bottom=0)
    ws = s["windows"]
    ttft_ax.step([w["start_s"] for w in ws], [w["ttft_p99_ms"] for w in ws], where="post")
    ttft_ax.set_ylabel("TTFT p99 per window (ms)")
    hit_ax.step([w["start_s"] for w in ws], [w["hit_rate"] for w in ws], where="post")
    hit_ax.set_ylabel("prefix hit rate per window")
    hit_ax.set_ylim(0, 1)
    hit_ax.set_xlabel("seconds into the run")
    for ax in (rss_ax, ttft_ax, hit_ax):
        for fault in s["faults"]:
            ax.axvline(fault["at_s"], color="tab:red", alpha=0.3, linestyle="--")
        ax.grid(True, alpha=0.3)
    for fault in s["faults"]:
        rss_ax.annotate(
            fault["what"],
            (fault["at_s"], 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            color="tab:red",
        )
    rss_ax.set_title(f"soak: {s['minutes']:g} min at {s['rate_per_s']:g} req/s (dashed: faults)")
    figures.save_figure(fig, path)


async def soak(run: Run, log_dir: Path) -> dict[str, Any]:
    duration_s = run.minutes * 60
    replicas = Replicas(log_dir)
    redis = RedisServer().start()
    try:
        for i in range(REPLICAS):
            await asyncio.to_thread(replicas.start, i)
        keys = Keys()
        config = {
            **keys.config(),
            "index": {"backend": "redis", "redis_url": redis.url, "ttl_s": INDEX_TTL_S},
            "health": {"interval_s": 0.5, "timeout_s": 1.0, "fail_after": 1},
            "pools": [{"name": "default", "models": [SIM_MODEL], "replicas": replicas.urls}],
        }
        gateway_log = log_dir / "gateway-soak.log"
        gateway_log.unlink(missing_ok=True)  # appended to otherwise: this run's lines only
        with gateway_from_config(config, log_dir, "soak") as gw:
            assert gw.proc.pid is not None
            await add_admin_tenant(gw.url, keys)
            run.t0 = time.monotonic()
            stop = asyncio.Event()
            background = [
                asyncio.create_task(sample_rss(gw.proc.pid, run, stop)),
                asyncio.create_task(inject_faults(run, duration_s, replicas, redis, stop)),
            ]
            try:
                await drive(gw.url, run, duration_s, keys)
            finally:
                stop.set()
                await asyncio.gather(*background)
            run.gateway = await gateway_counters(gw.url)
            run.in_flight_after = await settled_in_flight(gw.url)
        run.logged = logged_problems(gateway_log)
    finally:
        replicas.stop_all()
        redis.stop()
    classify(run, replicas.urls)
    return summarize(run, duration_s)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench.soak",
        description="Steady traffic through a gateway (Redis index) in front of simulated "
        "replicas, with replica crashes and restarts, a Redis restart, slow and abandoning "
        "clients; reports failed requests, the gateway's RSS over time and TTFT p99.",
    )
    p.add_argument("--minutes", type=float, default=DEFAULT_MINUTES, help="length of the run")
    p.add_argument("--rate", type=float, default=DEFAULT_RATE, help="requests per second")
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals, prompts and clients")
    p.add_argument(
        "--out", type=Path, default=Path("results/bench_soak.json"), help="JSON; the PNG beside it"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.minutes <= 0 or args.rate <= 0:
        raise SystemExit("--minutes and --rate must be positive")
    out: Path = args.out
    run = Run(args.minutes, args.rate, args.seed)
    summary = asyncio.run(soak(run, out.parent / f"{out.stem}_logs"))
    write_json(out, summary)
    plot(out.with_suffix(".png"), summary)
    Console().print(table(summary))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 1 if summary["failed_not_allowed"] else 0


if __name__ == "__main__":
    sys.exit(main())
