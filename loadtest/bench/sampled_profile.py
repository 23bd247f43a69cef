"""Where cachelane's CPU goes at saturation, by a sampling profiler that adds nothing to a call.

    python -m loadtest.bench.sampled_profile --py-spy /tmp/pyspy/bin/py-spy   # ~45 s

py-spy is not one of the project's dependencies: install it apart, e.g.
`python3 -m venv /tmp/pyspy && /tmp/pyspy/bin/pip install py-spy`.

loadtest/bench/request_account.py profiles one request at a time under cProfile, which charges
every Python call its own overhead (~4-5x a request's CPU), more to code made of many small calls
than to code that runs in C; this samples the stack of `cachelane serve --replicas` (cache_aware,
one worker, as loadtest/bench/overhead_floor.py starts it) RATE_HZ times a second from outside
the process, while the floor benchmark's closed loop of streamed 256-token requests (32 in
flight) keeps it busy. py-spy samples a process that is runnable, also while it waits for a core
on a shared machine, so a sample is a share of the time the gateway wanted a core, not of its
CPU; the shares are scaled to its CPU per request, from /proc, over the same seconds.

Each sample goes to the innermost frame of its stack that one of PHASES names (a request's
steps, in the order it meets them), so a phase is what ran inside it and no phase inside that;
what none names (the event loop's own C code, mostly) is the rest. By package: the sample's
innermost frame's file.
"""

from __future__ import annotations

import asyncio
import collections
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from loadtest.bench import harness, report
from loadtest.bench.overhead import closed_loop, cpu_seconds, zero_delay_fleet
from loadtest.bench.overhead_floor import SHORT_TOKENS, body_maker
from loadtest.bench.peer_routers import RouterSpec, running_router

OUT_PATH = Path("results/bench_sampled_profile.json")
RATE_HZ = 200  # py-spy's samples per second
DURATION_S = 20  # ~4,000 samples: a phase of 1% is ~40 of them
WARMUP_S = 3.0  # the connections opened, the index and the cost fit past their first requests
# (phase, function names): a name ending in "." is a class's every method
PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("uvicorn send (the socket write; the floor's too)", ("RequestResponseCycle.send",)),
    ("TTFT fit update (batched, off the request)", ("CostLearner.learn_queued",)),
    ("index write: prompt sent", ("Settlement.accepted", "IndexConfirmation.on_accepted")),
    ("upstream connect + send (aiohttp)", ("AiohttpUpstream.post", "ClientRequest.write_bytes")),
    (
        "relay: chunk reads, usage scan, sends' own frames",
        (
            "Proxy._relay",
            "RelayResponse._send_all",
            "ResponseHandler.data_received",
            "Settlement.accepted_while_reading",
        ),
    ),
    ("plan: decide (route)", ("route",)),
    ("plan: candidates' loads", ("Planner._route.<locals>.<listcomp>",)),
    ("plan: prompt, hash, lookup, the rest", ("Planner.plan",)),
    ("flow control + reserve", ("dispatch_now",)),
    ("body read + JSON parse", ("read_json",)),
    (
        "auth, rate limits, request checks",
        ("authenticate", "RateLimiter.", "check_request", "check_fields"),
    ),
    ("settlement: accounting, usage metrics", ("Settlement.settle",)),
    ("first byte: observers, index loaded", ("Settlement.first_byte",)),
    ("decision and rate-limit headers", ("decision_headers", "hide_decision")),
    ("decision metrics, notes", ("_count_decision", "note_plan", "Prewarmer.")),
    ("request counts at the end", ("_count",)),
    ("access record (open, each message, close)", ("AccessWatch.",)),
    ("request layer + body deadline", ("deadline_receive", "RequestLayer.")),
    (
        "client-gone watches, stream finish, upstream close",
        ("while_client_waits", "TaskWatch.", "close_shielded", "OpenStream.finish"),
    ),
    ("response objects", ("RelayResponse.__init__", "RelayResponse.__call__", "Proxy._stream")),
    ("the proxy's try (timeouts, lease)", ("Proxy._try", "Proxy._forward", "Proxy.forward")),
    ("uvicorn protocol (parse, task start)", ("HttpToolsProtocol.", "DeadlineHttpToolsProtocol.")),
    ("health checks, scrapes", ("Scraper.", "HealthChecker.")),
    ("the endpoint's own frames", ("serve", "chat_completions")),
    (
        "ASGI entry, Request object",
        (
            "_App._serve_hot",
            "_App.__call__",
            "ProxyHeadersMiddleware.__call__",
            "RequestResponseCycle.run_asgi",
        ),
    ),
)
REST = "the rest (the event loop's own code, mostly)"


def parse_raw(lines: Iterable[str]) -> list[tuple[list[tuple[str, str]], int]]:
    """py-spy's `--format raw` lines ("frame;frame;... count", a frame "name (file:line)"), as
    ([(name, file), ...] root first, count)."""
    out = []
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        frames = []
        for frame in stack.split(";"):
            name, _, where = frame.rpartition(" (")
            frames.append((name, where.rsplit(":", 1)[0]))
        out.append((frames, int(count)))
    return out


def _names(name: str, names: tuple[str, ...]) -> bool:
    return any(name == n or (n.endswith(".") and name.startswith(n)) for n in names)


def by_phase(samples: Sequence[tuple[list[tuple[str, str]], int]]) -> dict[str, int]:
    """Samples per phase: the innermost frame any phase names decides (REST: none does)."""
    counts: collections.Counter[str] = collections.Counter()
    for frames, n in samples:
        phase = next(
            (p for name, _ in reversed(frames) for p, names in PHASES if _names(name, names)), REST
        )
        counts[phase] += n
    return {p: counts[p] for p, _ in (*PHASES, (REST, ()))}


def package_of(path: str) -> str:
    if path.startswith("<"):  # <string> (a dataclass's or a NamedTuple's made code), <frozen ...>
        return "generated code, frozen modules"
    parts = path.split("/")
    if parts[0] in ("gateway", "routing"):
        return "/".join(parts[:2]) if len(parts) > 2 else parts[0]
    return parts[0].removesuffix(".py")


def by_package(samples: Sequence[tuple[list[tuple[str, str]], int]]) -> dict[str, int]:
    counts: collections.Counter[str] = collections.Counter()
    for frames, n in samples:
        counts[package_of(frames[-1][1])] += n
    return dict(counts.most_common())


def record(py_spy: str, out: Path) -> dict[str, Any]:
    """Run the gateway under load, py-spy recording; its raw samples and the CPU they cover."""
    make = body_maker(SHORT_TOKENS, stream=True)
    raw = out.with_suffix(".raw")
    log_dir = harness.log_dir(out)
    spec = RouterSpec("cachelane", "cache_aware")
    with zero_delay_fleet(log_dir) as urls, running_router(spec, urls, log_dir) as gateway:
        asyncio.run(closed_loop(gateway.url, WARMUP_S, body=make))
        spy = subprocess.Popen(
            [py_spy, "record", "-r", str(RATE_HZ), "-f", "raw", "-o", str(raw),
             "-p", str(gateway.pid), "-d", str(DURATION_S)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        before = cpu_seconds(gateway.pid)
        ok, errors, wall_s = asyncio.run(closed_loop(gateway.url, DURATION_S, body=make))
        cpu_s = cpu_seconds(gateway.pid) - before
        spy.wait(timeout=DURATION_S + 30)
    if spy.returncode != 0 or not raw.exists():
        raise RuntimeError(f"py-spy exited with {spy.returncode} (as root, or with ptrace?)")
    samples = parse_raw(raw.read_text().splitlines())
    total = sum(n for _, n in samples)
    us = 1e6 * cpu_s / max(ok, 1)

    def rows(counts: dict[str, int]) -> list[dict[str, Any]]:
        return [{"name": k, "share": v / total, "us": us * v / total} for k, v in counts.items()]

    return {
        "requests": ok, "errors": errors, "wall_s": wall_s, "gateway_cpu_s": cpu_s,
        "us_per_request": us, "requests_per_cpu_s": ok / cpu_s if cpu_s else None,
        "samples": total, "phases": rows(by_phase(samples)), "packages": rows(by_package(samples)),
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = harness.parser(
        "sampled_profile", "cachelane's CPU per request at saturation, by phase, sampled by py-spy"
    )
    parser.add_argument("--py-spy", default="py-spy", help="py-spy's executable")
    parser.add_argument("--out", type=Path, default=OUT_PATH)
    args = parser.parse_args(argv)
    console = harness.console(120)
    payload: dict[str, Any] = {}

    def arms() -> None:
        payload.update(record(args.py_spy, args.out))

    code = harness.run_arms(console, "sampled_profile", arms, (RuntimeError, OSError))
    if code:
        return code
    for key, title in (("phases", "phase"), ("packages", "package (innermost frame)")):
        t = Table(title=f"gateway CPU per request by {title}: {payload['us_per_request']:,.0f} us")
        report.add_columns(t, (title, "us", "share"), left=(title,))
        for r in payload[key]:
            t.add_row(r["name"], f"{r['us']:,.0f}", f"{100 * r['share']:.1f}%")
        console.print(t)
    console.print(
        f"{payload['requests']:,} requests ({payload['errors']} errors) in "
        f"{payload['wall_s']:.1f} s, {payload['requests_per_cpu_s']:,.0f} per gateway "
        f"CPU-second; {payload['samples']:,} samples"
    )
    report.write_json(args.out, payload)
    console.print(f"wrote {args.out} (the raw samples: {args.out.with_suffix('.raw')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
