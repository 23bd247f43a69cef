"""Where a request's time in cachelane goes: a CPU profile of `cachelane serve`, by phase.

    python -m loadtest.bench.request_account                    # 3,000 streamed requests
    python -m loadtest.bench.request_account --requests 500     # quicker

A zero-delay simulated fleet (loadtest/bench/overhead.py's) and `cachelane serve --replicas`
(cache_aware, one worker) run as processes; the gateway runs under cProfile with the process's
CPU clock (time.process_time: a neighbour taking the core is not charged), switched on after a
warm-up by SIGUSR1 and written out by SIGUSR2, so start-up is not in it. The client sends
streamed 256-token chat requests one at a time: at low load a request's CPU in the gateway is
its added time. The profile is then read by phase: each phase is the cumulative CPU of the
functions that do it (PHASES), per request, in the order a request meets them; what no phase
claims (the event loop, the server's parsing and writing) is shown by package.

cProfile's own cost inflates every function call by about the same amount, so the shares are
the figure to read; the absolute microseconds are scaled to the unprofiled CPU per request
measured by loadtest/bench/overhead_floor.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pstats
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtest.bench import harness, report
from loadtest.bench.overhead import Sample, _client, _one, cpu_seconds, zero_delay_fleet
from loadtest.bench.overhead_floor import SHORT_TOKENS, body_maker
from loadtest.bench.processes import ManagedProcess, free_port, wait_ready

OUT_PATH = Path("results/bench_request_account.json")
REQUESTS = 3_000
WARMUP = 200
DUMP_WAIT_S = 20.0
IDLE_S = 5.0  # the gateway left idle: its background CPU (health checks, scrapes) per second

# The gateway under cProfile; SIGUSR1 starts the profile, SIGUSR2 stops it and writes it.
LAUNCH = """
import cProfile, signal, sys, time
profile = cProfile.Profile(time.process_time)
def stop(*_):
    profile.disable()
    profile.dump_stats({path!r})
signal.signal(signal.SIGUSR1, lambda *_: profile.enable())
signal.signal(signal.SIGUSR2, stop)
import gateway.cli.main
sys.exit(gateway.cli.main.main())
"""

# (phase, when, functions, minus): cumulative CPU of `functions` less that of `minus` (the
# phases nested inside them, shown on their own rows), in the order a request meets them;
# `when`: before the first byte is sent, after it (gateway/serving/relay_response.py
# OpenStream.first_sent: the first byte's work; with these zero-delay replicas the index write
# of the prompt sent too, which a replica's prefill otherwise hides), per chunk, or after the last.
F = tuple[tuple[str, str], ...]
HASH: F = (("routing/hashing.py", "block_hashes"), ("routing/prompt.py", "chat_text"))
LOOKUP: F = (("gateway/serving/planner.py", "_lookup"),)
DECIDE: F = (("gateway/serving/planner.py", "_route"),)
LOADED: F = (("gateway/serving/planner.py", "record_loaded"),)
SETTLE: F = (("gateway/serving/settlement.py", "settle"),)
LEARN: F = (("gateway/accounting/calibration.py", "learn_queued"),)
PHASES: tuple[tuple[str, str, F, F], ...] = (
    ("auth (key -> tenant)", "before", (("gateway/serving/handling.py", "authenticate"),), ()),
    (
        "rate limits",
        "before",
        (
            ("gateway/tenancy/rate_limits.py", "admit_request"),
            ("gateway/tenancy/rate_limits.py", "admit_tokens"),
        ),
        (),
    ),
    ("body read + JSON parse", "before", (("gateway/http/serve.py", "read_json"),), ()),
    (
        "request checks (fields, schema)",
        "before",
        (
            ("gateway/http/request_schema.py", "check_request"),
            ("gateway/http/body_fields.py", "check_fields"),
        ),
        (),
    ),
    ("plan: prompt text + hash", "before", HASH, ()),
    ("plan: index lookup", "before", LOOKUP, ()),
    ("plan: decide (candidates, estimate, rank)", "before", DECIDE, ()),
    (
        "plan: the rest (tokens, admission, Plan)",
        "before",
        (("gateway/serving/planner.py", "plan"),),
        HASH + LOOKUP + DECIDE,
    ),
    ("flow control + reserve", "before", (("gateway/serving/handling.py", "dispatch_now"),), ()),
    (
        "decision metrics + log + trace notes",
        "before",
        (
            ("gateway/http/serve.py", "_count_decision"),
            ("gateway/telemetry/logs.py", "note_plan"),
            ("gateway/telemetry/tracing.py", "note_plan"),
        ),
        (),
    ),
    (  # the work it waits on runs in the request's own task, inside it: not the watch's
        "client-gone watch (a timer; a watcher past DISCONNECT_POLL_S)",
        "before",
        (("gateway/http/disconnect.py", "while_client_waits"),),
        (("gateway/serving/proxy.py", "_forward"), ("gateway/serving/handling.py", "hold")),
    ),
    ("upstream connect + send (aiohttp)", "before", (("gateway/serving/upstream.py", "post"),), ()),
    (
        "index write: prompt sent",
        "after first",
        (("gateway/serving/planner.py", "record_sent"),),
        (),
    ),
    ("index write: prompt loaded", "after first", LOADED, ()),
    (
        "first-byte metrics (TTFT histograms, objective)",
        "after first",
        (("gateway/serving/settlement.py", "first_byte"),),
        LOADED,
    ),
    (
        "response headers (decision headers)",
        "before",
        (("gateway/serving/proxy.py", "decision_headers"),),
        (),
    ),
    (
        "relay: chunk reads + usage scan",
        "per chunk",
        (("gateway/serving/proxy.py", "_relay"),),
        SETTLE,
    ),
    ("settlement: usage counters, costs, capture, fit queue", "after last", SETTLE, ()),
    ("TTFT fit update (batched, off the request)", "after last", LEARN, ()),
    (
        "access log line (format + write)",
        "after last",
        (
            ("gateway/telemetry/logs.py", "fields"),
            ("gateway/telemetry/logs.py", "key_values"),
            ("logging/__init__.py", "log"),
        ),
        (),
    ),
)
BACKGROUND_FILES = (
    "gateway/fleet/scraper.py",
    "gateway/fleet/registry.py",
    "gateway/serving/prewarm.py",
    "gateway/accounting/ledger_store.py",
    "gateway/accounting/fit_store.py",
    "gateway/serving/flow.py",
    "gateway/tenancy/store.py",
    "httpx/",
    "httpcore/",
)
# Where the tasks that serve no request start (health checks, engine-metric scrapes, stores):
# a request's CPU is the profile's less what ran under these roots.


@contextlib.contextmanager
def profiled_gateway(replicas: Sequence[str], log_dir: Path, dump: Path) -> Iterator[Any]:
    port = free_port()
    args = [
        sys.executable, "-c", LAUNCH.format(path=str(dump)), "serve",
        "--replicas", ",".join(replicas), "--policy", "cache_aware", "--port", str(port),
        "--log-level", "info",  # the default: the access line is written, as users get it
    ]  # fmt: skip
    proc = ManagedProcess("cachelane (profiled)", args, log_dir / "profiled-gateway.log")
    try:
        proc.start()
        wait_ready(proc, [f"http://127.0.0.1:{port}/ready"])
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


async def send_sequentially(url: str, requests: int, pid: int) -> dict[str, float]:
    """Warm up; `requests` streamed requests one at a time unprofiled (the gateway's CPU per
    request, from /proc), then as many profiled; their wall times (s)."""
    make = body_maker(SHORT_TOKENS, stream=True)
    errors = 0
    async with _client(url) as client:

        async def send(tag: int) -> float:
            nonlocal errors
            started = time.perf_counter()
            for i in range(requests):
                sample = Sample()
                await _one(client, make(tag, i), sample)
                errors += sample.error is not None
            return time.perf_counter() - started

        for i in range(WARMUP):
            await _one(client, make(-1, i), Sample())
        cpu_before = cpu_seconds(pid)
        await asyncio.sleep(IDLE_S)
        background_per_s = (cpu_seconds(pid) - cpu_before) / IDLE_S
        cpu_before = cpu_seconds(pid)
        unprofiled_s = await send(0)
        cpu_s = cpu_seconds(pid) - cpu_before - background_per_s * unprofiled_s
        os.kill(pid, signal.SIGUSR1)
        profiled_s = await send(1)
        os.kill(pid, signal.SIGUSR2)
    if errors:
        raise RuntimeError(f"{errors} of {2 * requests} requests failed")
    return {
        "unprofiled_wall_s": unprofiled_s,
        "background_cpu_per_s": background_per_s,
        "unprofiled_cpu_us_per_request": cpu_s * 1e6 / requests,
        "profiled_wall_s": profiled_s,
    }


# Self time of the ASGI layers between uvicorn and the endpoint (the middlewares' own frames).
MIDDLEWARE_FILES = (
    "gateway/http/request_layer.py",
    "gateway/telemetry/logs.py",
    "gateway/http/exposure.py",
    "gateway/telemetry/tracing.py",
    "gateway/http/app.py",
)
MIDDLEWARE_NAMES = {
    "__call__", "_serve", "_answer", "sent", "timed_receive", "dispatch", "_serve_hot", "receive",
    "send",
}  # fmt: skip
PACKAGES = (
    ("uvicorn + httptools (server)", ("uvicorn/", "httptools")),
    ("asyncio + uvloop (event loop)", ("asyncio/", "uvloop", "{method 'run_until_complete'")),
    ("aiohttp (upstream client)", ("aiohttp/", "multidict", "yarl")),
    (
        "prometheus_client + gateway/telemetry/metrics.py",
        ("prometheus_client/", "gateway/telemetry/metrics.py"),
    ),
    ("starlette + fastapi", ("starlette/", "fastapi/")),
    ("logging", ("logging/",)),
    ("json", ("json/", "orjson")),
    ("routing/", ("routing/",)),
    ("gateway/ (all its own modules)", ("gateway/",)),
)


def _where(key: tuple[str, int, str]) -> str:
    return key[0].replace(os.sep, "/")


def _cumulative(stats: dict[Any, Any], functions: tuple[tuple[str, str], ...]) -> float:
    return sum(
        float(row[3])
        for key, row in stats.items()
        for ending, name in functions
        if key[2] == name and _where(key).endswith(ending)
    )


def wait_for_file(path: Path) -> None:
    """The profile, once the gateway has written it (SIGUSR2)."""
    deadline = time.monotonic() + DUMP_WAIT_S
    while not path.exists() or path.stat().st_size == 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no profile written to {path} in {DUMP_WAIT_S:.0f} s")
        time.sleep(0.1)
    time.sleep(0.5)  # dump_stats writes in one go; let it finish


def account(dump: Path, requests: int, unprofiled_us: float) -> dict[str, Any]:
    """Per request CPU by phase and by package: profiled us, share of the requests' profiled
    CPU (all but what ran under background roots: BACKGROUND_FILES), and that share of the
    unprofiled CPU per request less the background's (`unprofiled_us`, the figure to read)."""
    stats: dict[Any, Any] = pstats.Stats(str(dump)).stats  # type: ignore[attr-defined]
    total = sum(row[2] for row in stats.values())
    per = 1e6 / requests
    phases: list[dict[str, Any]] = [
        {
            "phase": name,
            "when": when,
            "us": (_cumulative(stats, fns) - _cumulative(stats, minus)) * per,
        }
        for name, when, fns, minus in PHASES
    ]
    middleware = sum(
        row[2]
        for key, row in stats.items()
        if key[2] in MIDDLEWARE_NAMES and _where(key).endswith(MIDDLEWARE_FILES)
    )
    phases.insert(
        0, {"phase": "middleware layers (own frames)", "when": "both", "us": middleware * per}
    )
    packages = []
    for name, needles in PACKAGES:
        self_s = sum(row[2] for key, row in stats.items() if any(n in _where(key) for n in needles))
        packages.append({"package": name, "us": self_s * per})
    background = sum(
        row[3]
        for key, row in stats.items()
        if not row[4] and any(f in _where(key) for f in BACKGROUND_FILES)
    )
    request_us = (total - background) * per
    named = sum(float(r["us"]) for r in phases)
    phases.append(
        {
            "phase": "the rest: server, event loop, responses",
            "when": "both",
            "us": request_us - named,
        }
    )
    for row in phases + packages:
        row["share"] = row["us"] / request_us if request_us else 0.0
        row["scaled_us"] = row["share"] * unprofiled_us
    return {
        "total_us": total * per, "request_us": request_us,
        "background_us": total * per - request_us, "phases": phases, "packages": packages,
    }  # fmt: skip


def print_tables(console: Console, payload: dict[str, Any]) -> None:
    acc = payload["account"]
    t = Table(
        title=f"gateway CPU per request by phase: {payload['unprofiled_cpu_us_per_request']:,.0f}"
        f" us unprofiled; profiled {acc['total_us']:,.0f} us, of which the requests' "
        f"{acc['request_us']:,.0f} us (100%), background (health, scrapes) the rest"
    )
    columns = ("phase", "when", "us", "share", "us (profiled)")
    report.add_columns(t, columns, left=("phase", "when"))
    for r in acc["phases"]:
        t.add_row(
            r["phase"], r["when"], f"{r['scaled_us']:,.0f}", f"{r['share']:.1%}", f"{r['us']:,.0f}"
        )
    console.print(t)
    t = Table(title="self time by package, whole process (background included)")
    report.add_columns(t, ("package", "us", "share", "us (profiled)"), left=("package",))
    for r in acc["packages"]:
        t.add_row(r["package"], f"{r['scaled_us']:,.0f}", f"{r['share']:.1%}", f"{r['us']:,.0f}")
    console.print(t)
    console.print(
        f"{payload['requests']} requests unprofiled in {payload['unprofiled_wall_s']:.1f} s, "
        f"then profiled in {payload['profiled_wall_s']:.1f} s; load average "
        f"{payload['load_average']}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = harness.parser("request_account", __doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--out", type=Path, default=OUT_PATH)
    args = parser.parse_args(argv)
    console = harness.console(150)
    logs = harness.log_dir(args.out)
    dump = logs / "gateway.prof"
    dump.unlink(missing_ok=True)
    payload: dict[str, Any] = {"requests": args.requests}

    def arms() -> None:
        with zero_delay_fleet(logs) as urls, profiled_gateway(urls, logs, dump) as (proc, url):
            assert proc.pid is not None
            payload.update(asyncio.run(send_sequentially(url, args.requests, proc.pid)))
            wait_for_file(dump)
            payload["load_average"] = os.getloadavg()
        payload["account"] = account(dump, args.requests, payload["unprofiled_cpu_us_per_request"])

    code = harness.run_arms(console, "request_account", arms)
    if code:
        return code
    print_tables(console, payload)
    report.write_json(args.out, payload)
    console.print(f"wrote {args.out}; the profile is {dump}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
