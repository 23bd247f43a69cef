"""Routing parity through the real gateway: one recorded trace, the gateway at two commits.

    python -m loadtest.bench.route_parity --before 56f9262 --after HEAD   # ~5 min
    python -m loadtest.bench.route_parity --quick                         # the machinery, ~1 min

Each commit is checked out in a temporary `git worktree` and its gateway runs from there (that
tree's gateway/ and routing/, as `serve --config` of that commit reads the config); the simulated
fleet is this checkout's (`python -m loadtest.sim --config`), fresh for every run, on the same
ports, so only the gateway differs. The fleet: 4 replicas in two pools, two with a large HBM and
two with a small HBM, a CPU tier and a shared remote tier (loadtest/bench/routing.py's sizes).

Sequential phase: the trace (multi-turn chat and RAG over shared documents) is sent one request
at a time, the next only once the previous has finished and the gateway counts nothing in
flight, so every decision sees the same load. Calibration is off (`routing.calibration: none`:
estimates would otherwise follow measured TTFTs) and so is engine-metrics scraping (its samples
land at times no run repeats); what is left is the routing, a function of the trace. Per request
the gateway's decision headers are kept (replica, reason, expected cached tokens, remote write,
the estimate's terms but the measured gateway and relay times) and compared.

Concurrent phase: the same trace from CLIENTS closed-loop clients with the configuration's
defaults (calibration on, scraping on); identical routing is not expected, so it compares hit
rate and TTFT as after / before ratios, beside each commit's own spread over its repeats (the
noise). Writes results/bench_route_parity.json, the trace and per-request lines beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console

from loadtest.bench import harness, report
from loadtest.bench.peer_routers import REPO, RouterSpec, running_router
from loadtest.bench.processes import HTTP_TIMEOUT_S, POLL_INTERVAL_S, free_port_run, sim_from_config
from loadtest.bench.replay import (
    CONNECT_TIMEOUT_S,
    RequestResult,
    Summary,
    errors_into,
    open_client,
    replay,
    request_body,
    stream_into,
    summarize,
)
from loadtest.bench.route_parity_report import (
    CLIENTS,
    Decision,
    compare,
    concurrent_table,
    differences_table,
    sequential_table,
)
from loadtest.bench.routing import HBM_CAPACITY_TOKENS, TIERED_CPU_TOKENS, TIERED_HBM_TOKENS
from loadtest.sim.config import SIM_MODEL
from loadtest.workloads import traces

OUT_PATH = Path("results/bench_route_parity.json")

REQUESTS = 300  # a few hundred: dozens of conversations and documents, each seen several times
QUICK_REQUESTS = 40
QUICK_HELP = f"{QUICK_REQUESTS} requests and one concurrent run each: the machinery"
DESCRIPTION = (
    "The gateway at two commits on one recorded trace: the same decisions, request by request, "
    "then hit rate and TTFT under concurrency as ratios."
)
TRACE_MIX = {"chat": 0.5, "rag": 0.5}
TRACE_RATE_PER_S = 8.0
# Only shapes the trace (how conversations interleave, how soon a turn follows the last): the
# sequential phase ignores the offsets and the concurrent one sends as fast as its clients go.
REPEATS = 2  # concurrent runs per commit, alternated: the spread between two is the noise

SETTLE_TIMEOUT_S = 10.0
# After a request's last byte, the gateway settles it (in-flight count, index confirmation) in
# microseconds to milliseconds; 10 s means it did not, and the run stops rather than guess.
RUN_TIMEOUT_S = 900.0
# The bound on one concurrent run: 300 requests of ~0.5 s over 4 clients take ~40 s.

POOLS = (
    ("hbm", 2, {"hbm_capacity_tokens": HBM_CAPACITY_TOKENS}),
    (
        "tiered",
        2,
        {
            "hbm_capacity_tokens": TIERED_HBM_TOKENS,
            "cpu_capacity_tokens": TIERED_CPU_TOKENS,
            "remote_tier": "kv",
        },
    ),
)

IN_FLIGHT = re.compile(r"^cachelane_replica_in_flight\{[^}]*\} ([0-9.e+-]+)$", re.M)
HEADER_PREFIX = "x-cachelane-"
MEASURED_TERMS = ("gateway", "relay")  # measured per request, not part of the decision


# --- the commits ----------------------------------------------------------------------------


def git(*args: str) -> str:
    """A git command in this repository; its failure (stderr) as a RuntimeError."""
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


@contextlib.contextmanager
def worktree(label: str, rev: str, into: Path) -> Iterator[Path]:
    """`rev` checked out (detached) in a temporary git worktree `into`/`label`, removed on exit."""
    path = into / label
    git("worktree", "add", "--detach", str(path), rev)
    try:
        check_tree(path)
        yield path
    finally:
        with contextlib.suppress(RuntimeError):
            git("worktree", "remove", "--force", str(path))


def check_tree(tree: Path) -> None:
    """The gateway that RouterSpec(source=tree) starts is that tree's, not this checkout's."""
    code = (
        f"import sys; sys.path.insert(0, {str(tree)!r}); import gateway, routing; "
        "print(gateway.__file__); print(routing.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    stray = [f for f in out.stdout.split() if not Path(f).is_relative_to(tree)]
    if stray:
        raise RuntimeError(f"{tree}: imports resolved outside the tree: {stray}")


# --- the fleet and the gateway's config -------------------------------------------------------


@dataclass(frozen=True)
class Fleet:
    """Loopback URLs picked once, so every run (either commit) sees the same replica names."""

    pools: dict[str, list[str]]
    remote_url: str

    @classmethod
    def pick(cls) -> Fleet:
        count = sum(n for _, n, _ in POOLS)
        port = free_port_run(count + 1)
        urls = iter(f"http://127.0.0.1:{port + i}" for i in range(count + 1))
        pools = {name: [next(urls) for _ in range(n)] for name, n, _ in POOLS}
        return cls(pools, next(urls))

    def labels(self) -> dict[str, str]:
        """The gateway's replica name (host:port) -> pool-i, for reading the tables."""
        return {
            httpx.URL(u).netloc.decode(): f"{name}-{i}"
            for name, urls in self.pools.items()
            for i, u in enumerate(urls)
        }

    def config(self, *, deterministic: bool) -> dict[str, Any]:
        """One config both commits read (their schemas agree on every key used here)."""
        pools = [
            {"name": name, "models": [SIM_MODEL], "replicas": self.pools[name], **extra}
            for name, _, extra in POOLS
        ]
        data: dict[str, Any] = {
            "auth": {"mode": "open"},  # no tenants: no keys to check
            "routing": {"policy": "cache_aware", "seed": 0},
            "remote_tiers": [{"name": "kv", "url": self.remote_url}],
            "pools": pools,
        }
        if deterministic:
            data["routing"]["calibration"] = "none"
            data["engine_metrics"] = {"enabled": False}
        return data


@contextlib.contextmanager
def gateway_at(
    tree: Path, fleet: Fleet, deterministic: bool, logs: Path, name: str
) -> Iterator[str]:
    """A fresh simulated fleet (cold caches) and the gateway of `tree` in front of it: its URL."""
    config = fleet.config(deterministic=deterministic)
    path = logs / f"gateway-{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    spec = RouterSpec("cachelane", "cache_aware", config=path, label_suffix=f"-{name}", source=tree)
    with (
        sim_from_config(config, logs, name),
        running_router(spec, [], logs) as router,
    ):
        yield router.url


# --- the sequential phase ---------------------------------------------------------------------


def read_decision(resp: httpx.Response, labels: dict[str, str], into: Decision) -> None:
    h = resp.headers
    replica = h.get(f"{HEADER_PREFIX}replica", "")
    into.replica = labels.get(replica, replica)
    into.reason = h.get(f"{HEADER_PREFIX}reason", "")
    into.expected_cached_tokens = h.get(f"{HEADER_PREFIX}expected-cached-tokens", "")
    into.remote_write = h.get(f"{HEADER_PREFIX}remote-write", "")
    terms = h.get(f"{HEADER_PREFIX}est-terms-ms", "").split(",")
    into.estimate = ",".join(t for t in terms if t.split("=")[0] not in MEASURED_TERMS)


async def settled(client: httpx.AsyncClient) -> None:
    """Wait until the gateway counts no request in flight on any replica (its /metrics)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        text = (await client.get("/metrics")).text
        if not any(float(v) for v in IN_FLIGHT.findall(text)):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway still counts requests in flight after {text!r:.200}")
        await asyncio.sleep(POLL_INTERVAL_S / 10)


async def sequential(
    trace: Sequence[traces.TraceRecord], url: str, labels: dict[str, str]
) -> tuple[list[RequestResult], list[Decision]]:
    """Every record in order, one at a time: each after the previous has settled."""
    results = [RequestResult(i, r["tenant"], r["endpoint"], 0.0) for i, r in enumerate(trace)]
    decisions = [Decision() for _ in trace]
    timeout = httpx.Timeout(
        connect=CONNECT_TIMEOUT_S, read=RUN_TIMEOUT_S, write=HTTP_TIMEOUT_S, pool=None
    )
    async with open_client(url, 1, timeout, trust_env=False) as client:
        for record, result, decision in zip(trace, results, decisions, strict=True):
            await settled(client)
            with errors_into(result, "cancelled"):
                await stream_into(
                    client,
                    record,
                    request_body(record, traces.DEFAULT_MODEL),
                    result,
                    on_headers=functools.partial(read_decision, labels=labels, into=decision),
                )
    return results, decisions


# --- the concurrent phase ---------------------------------------------------------------------


async def concurrent(trace: Sequence[traces.TraceRecord], url: str) -> list[RequestResult]:
    """CLIENTS closed-loop clients over the trace in order: every record is due at once, and
    replay's in-flight cap lets CLIENTS of them run, the next starting as one ends."""
    due_now: list[traces.TraceRecord] = [{**r, "t_s": 0.0} for r in trace]
    return await replay(due_now, url, max_in_flight=CLIENTS, drain_timeout_s=RUN_TIMEOUT_S)


# --- the run ----------------------------------------------------------------------------------


def recorded_trace(args: argparse.Namespace, logs: Path) -> list[traces.TraceRecord]:
    """--trace's records, or a seeded chat + RAG trace of --requests records, written beside
    the results so the run can be repeated on exactly these requests."""
    if args.trace:
        return traces.read_trace(args.trace)[: args.requests]
    duration_s = args.requests / TRACE_RATE_PER_S * 2  # Poisson: ample, then cut
    trace = traces.generate(
        TRACE_MIX, rate_per_s=TRACE_RATE_PER_S, duration_s=duration_s, seed=args.seed
    )[: args.requests]
    traces.write_trace(trace, logs / "trace.jsonl")
    return trace


def run(args: argparse.Namespace, out: Console, payload: dict[str, Any]) -> None:
    logs = harness.log_dir(args.out.resolve())
    trace = recorded_trace(args, logs)
    revs = {"before": args.before, "after": args.after}
    commits = {k: git("rev-parse", "--verify", f"{rev}^{{commit}}") for k, rev in revs.items()}
    fleet = Fleet.pick()
    labels = fleet.labels()
    payload.update(commits=commits, requests=len(trace), fleet=fleet.config(deterministic=True))
    out.print(
        f"{len(trace)} requests; before {commits['before'][:9]}, after {commits['after'][:9]}"
    )
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="route-parity-")))
        trees = {k: stack.enter_context(worktree(k, c, tmp)) for k, c in commits.items()}
        summaries: dict[str, Summary] = {}
        decisions: dict[str, list[Decision]] = {}
        for label, tree in trees.items():
            with gateway_at(tree, fleet, True, logs, f"{label}-sequential") as url:
                started = time.perf_counter()
                results, decisions[label] = asyncio.run(sequential(trace, url, labels))
                summaries[label] = summarize(results, time.perf_counter() - started)
            report.write_results_jsonl(logs / f"{label}-sequential.jsonl", results)
            out.print(f"  {label} sequential: {summaries[label].ok}/{len(trace)} ok")
        cmp = compare(trace, decisions["before"], decisions["after"])
        out.print(sequential_table(commits, summaries, cmp))
        if cmp.differences:
            out.print(differences_table(cmp))
        payload["sequential"] = {
            "summaries": {k: s.to_dict() for k, s in summaries.items()},
            "comparison": asdict(cmp),
            "decisions": {k: [asdict(d) for d in v] for k, v in decisions.items()},
        }
        runs: dict[str, list[Summary]] = {"before": [], "after": []}
        for repeat in range(args.repeats):
            for label, tree in trees.items():
                name = f"{label}-concurrent-{repeat}"
                with gateway_at(tree, fleet, False, logs, name) as url:
                    started = time.perf_counter()
                    results = asyncio.run(concurrent(trace, url))
                    runs[label].append(summarize(results, time.perf_counter() - started))
                report.write_results_jsonl(logs / f"{name}.jsonl", results)
                out.print(f"  {name}: {runs[label][-1].ok}/{len(trace)} ok")
        table, ratios = concurrent_table(runs)
        out.print(table)
        payload["concurrent"] = {
            "clients": CLIENTS,
            "runs": {k: [s.to_dict() for s in v] for k, v in runs.items()},
            "ratios": ratios,
        }


def main(argv: Sequence[str] | None = None) -> int:
    parser = harness.parser("route_parity", DESCRIPTION, quick=QUICK_HELP)
    parser.add_argument("--before", default="56f9262", help="git rev (default: %(default)s)")
    parser.add_argument("--after", default="HEAD", help="git rev (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=None, help=f"default {REQUESTS}")
    parser.add_argument("--repeats", type=int, default=None, help=f"default {REPEATS}")
    parser.add_argument("--trace", type=Path, help="replay this JSONL trace instead")
    harness.add_seed_and_out(parser, OUT_PATH)
    args = parser.parse_args(argv)
    args.requests = args.requests or (QUICK_REQUESTS if args.quick else REQUESTS)
    args.repeats = args.repeats or (1 if args.quick else REPEATS)
    out = harness.console(width=140)
    payload: dict[str, Any] = {"seed": args.seed, "mix": TRACE_MIX}
    started = time.perf_counter()
    code = harness.run_arms(
        out, "route_parity", lambda: run(args, out, payload), harness.ARM_ERRORS
    )
    if code == 0:
        report.write_json(args.out, payload)
        out.print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")
        same = payload["sequential"]["comparison"]["same_routing"]
        return 0 if same == payload["requests"] else harness.FAILED
    return code


if __name__ == "__main__":
    sys.exit(main())
