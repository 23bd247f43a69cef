"""Does `cachelane plan` predict what the fleet does? Three set-ups run for real on the simulated
fleet, compared with the planner's prediction.

    python -m loadtest.bench.plan_validation            # ~4 minutes: 3 set-ups x 60 s
    python -m loadtest.bench.plan_validation --quick    # 8 s per set-up: checks the machinery
    python -m loadtest.bench.plan_validation --slowdown 4   # a fleet 4x slower than an H200

Set-ups (4 replicas, Llama-3.1-8B on H200 costs, routing/cost.py's defaults; with --slowdown N,
prefill, PCIe and network N times slower: the gateway is told the PCIe and network bandwidths, an
operator's known figures, and learns the prefill rate):
  hbm      HBM only, 12k tokens per replica
  cpu      + a CPU tier of 8k tokens per replica
  remote   + one shared remote tier (remote_write: reuse)

Traffic: loadtest/workloads/tier_traces.py, two tenants at once: `web` (standard), questions
about 24 shared 3-6k-token documents with Zipf popularity (`reuse` shape `high`, 8 req/s), and
`voice` (critical), short turns behind one system prompt (3 req/s). Each set-up is its own sim
fleet and a gateway with `capture.path` set; the seeded trace is replayed open-loop through it.

Prediction: the capture of the HBM-only run (its arrivals, block hashes, decode times and fitted
cost terms) is replayed by the planner on each of the three set-ups (a what-if: the cpu and
remote rows are predicted from traffic captured without those tiers). The planner is also run on
each set-up's own capture (same set-up: the model's error without the what-if). The remote
row's what-if is given the remote tier's lookup round trip, probed on the idle fleet before the
run (--remote-lookup-ms; the cost model has no term for it).

Measured: the TTFT the gateway observed (first byte from the replica: cachelane_ttft_seconds,
what the cost fit learns from) and the engines' cached tokens per prompt token, from each run's
capture; the client's TTFT (through the gateway, to the first streamed token) is in the JSON.
The requests the trace sends in its first WARMUP_S count in neither: the first that many by
arrival in each capture and each replay, so every row counts the same number of requests (a
request near the cut arrives on either side of it from run to run).

Writes results/plan_validation.json and prints the table docs/planning.md shows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from loadtest.bench import harness
from loadtest.bench.processes import (
    gateway_from_config,
    loopback_urls,
    sigterm_as_interrupt,
    sim_from_config,
)
from loadtest.bench.replay import RequestResult, replay
from loadtest.sim.config import SIM_MODEL
from loadtest.workloads import tier_traces
from loadtest.workloads.traces import TraceRecord
from routing.cost import PCIE_GBPS, PREFILL_TOKENS_PER_S, REMOTE_GBPS
from routing.whatif.capture import Capture, CapturedRequest, parse_capture
from routing.whatif.replay import Replayed
from routing.whatif.replay import replay as plan_replay
from routing.whatif.setup import Setup, hbm_only, with_cpu, with_remote
from routing.whatif.summary import ALL, percentile

DURATION_S = 60.0
QUICK_DURATION_S = 8.0
# 60 s per set-up: ~660 requests (~180 critical), so the critical class's p99 rests on ~2
# requests, the standard's on ~5; three set-ups plus start-up take ~4 minutes on the project's
# 2-core machine.
WARMUP_S = 5.0
# The first 5 s of each run are replayed (they fill the caches) but not counted, in the
# measurement as in the prediction: the gateway then routes on its seed cost terms while its fit
# converges (~50 requests, routing/learn.py), the replay on the fit it ended with.

REPLICAS = 4
HBM_TOKENS = 12_000
CPU_TOKENS = 8_000
REMOTE_TOKENS = 10_000_000
# tier_experiment.ReuseSetup's fleet: 4 x (12k HBM + 8k CPU) = 80k tokens of local tiers against
# ~110k tokens of shared documents, so documents leave HBM, then the CPU tier, and come back from
# the remote tier. 10M tokens of remote tier (the gateway's default remote capacity) hold them all.

WEB_RATE_PER_S = tier_traces.REUSE_RATE_PER_S
VOICE_RATE_PER_S = tier_traces.VOICE_RATE_PER_S
SEED = 0
GOAL = 0.20  # the goal: within 20%
HTTP_TIMEOUT_S = 5.0  # one loopback call

KEYS = {
    "voice": "voice-plan-key-1-0123456789abcdef0123456789",
    "web": "web-plan-key-1-0123456789abcdef0123456789",
}
SETUPS = ("hbm", "cpu", "remote")
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms", "hit_rate", "requests_hit_share")
LABELS = {
    "ttft_p50_ms": "TTFT p50 ms",
    "ttft_p99_ms": "TTFT p99 ms",
    "ttft_mean_ms": "TTFT mean ms",
    "hit_rate": "hit rate",
    "requests_hit_share": "requests hit",
}
OUT_JSON = Path("results/plan_validation.json")


def fleet_config(
    setup: str, replicas: list[str], remote: str, slowdown: float = 1.0
) -> dict[str, Any]:
    """The gateway's config (and the sim's, once `sim_costs` are added)."""
    pool: dict[str, Any] = {
        "name": "fleet",
        "replicas": replicas,
        "models": [SIM_MODEL],
        "hbm_capacity_tokens": HBM_TOKENS,
        "cpu_capacity_tokens": 0 if setup == "hbm" else CPU_TOKENS,
    }
    if slowdown != 1.0:
        pool["costs"] = {"pcie_gbps": PCIE_GBPS / slowdown, "remote_gbps": REMOTE_GBPS / slowdown}
    config: dict[str, Any] = {
        "tenants": [
            {"name": "voice", "api_key": KEYS["voice"], "class": "critical"},
            {"name": "web", "api_key": KEYS["web"], "class": "standard"},
        ],
        "pools": [pool],
    }
    if setup == "remote":
        pool |= {"remote_tier": "kv", "remote_write": "reuse"}
        config["remote_tiers"] = [{"name": "kv", "url": remote, "capacity_tokens": REMOTE_TOKENS}]
    return config


def predicted_setup(base: Setup, setup: str, lookup_s: float = 0.0) -> Setup:
    if setup == "hbm":
        return hbm_only(base)
    if setup == "cpu":
        return with_cpu(CPU_TOKENS)(hbm_only(base))
    return with_remote(CPU_TOKENS, REMOTE_TOKENS, "reuse", lookup_s)(hbm_only(base))


LOOKUP_PROBES = 50


def probe_lookup_s(remote_url: str) -> float:
    """The remote tier's lookup round trip on an idle fleet: the median of LOOKUP_PROBES calls,
    as an operator would measure their store before adding it (the planner's
    --remote-lookup-ms). Under load it is longer: the replicas' event loops are busy."""
    rng = random.Random(SEED)
    times = []
    with httpx.Client(base_url=remote_url, timeout=HTTP_TIMEOUT_S) as client:
        for _ in range(LOOKUP_PROBES):
            body = {"hashes": [rng.getrandbits(63) for _ in range(8)]}
            started = time.perf_counter()
            client.post("/lookup", json=body).raise_for_status()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def read_capture(path: Path) -> Capture:
    with path.open(encoding="utf-8") as f:
        return parse_capture(json.loads(line) for line in f if line.strip())


async def _both(
    url: str, voice: list[TraceRecord], web: list[TraceRecord]
) -> tuple[list[RequestResult], list[RequestResult]]:
    a, b = await asyncio.gather(
        replay(voice, url, model=SIM_MODEL, api_key=KEYS["voice"]),
        replay(web, url, model=SIM_MODEL, api_key=KEYS["web"]),
    )
    return a, b


def run_setup(
    setup: str,
    voice: list[TraceRecord],
    web: list[TraceRecord],
    log_dir: Path,
    slowdown: float = 1.0,
) -> tuple[dict[str, list[RequestResult]], Path, float | None]:
    urls = loopback_urls(REPLICAS + 1)
    config = fleet_config(setup, urls[1:], urls[0], slowdown)
    capture = log_dir / f"capture-{setup}.jsonl"
    sim_pool = dict(config["pools"][0])
    if setup != "remote":
        sim_pool["remote_tier"] = None
    if slowdown != 1.0:
        prefill = {"prefill_tokens_per_s": PREFILL_TOKENS_PER_S / slowdown}
        sim_pool["costs"] = {**sim_pool["costs"], **prefill}
    sim_config = {**config, "pools": [sim_pool]}
    with sim_from_config(sim_config, log_dir, setup):
        lookup_s = probe_lookup_s(urls[0]) if setup == "remote" else None
        gw_config = {**config, "capture": {"path": str(capture.resolve())}}
        with gateway_from_config(gw_config, log_dir, setup) as gw:
            crit, std = asyncio.run(_both(gw.url, voice, web))
    return {"critical": crit, "standard": std}, capture, lookup_s


def client_measured(results: dict[str, list[RequestResult]]) -> dict[str, dict[str, float]]:
    """The client's view: TTFT to the first streamed token, through the gateway."""
    out: dict[str, dict[str, float]] = {}
    groups = {**results, ALL: [r for rows in results.values() for r in rows]}
    for name, rows in groups.items():
        ok = [r for r in rows if r.ok and r.ttft_s is not None]
        ttfts = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
        prompt = sum(r.prompt_tokens for r in ok) or 1
        out[name] = {
            "requests": len(ok),
            "errors": len(rows) - len(ok),
            "ttft_p50_ms": percentile(ttfts, 50),
            "ttft_p99_ms": percentile(ttfts, 99),
            "ttft_mean_ms": statistics.fmean(ttfts) if ttfts else math.nan,
            "hit_rate": sum(r.cached_tokens for r in ok) / prompt,
        }
    return out


def _stats(ttfts_ms: list[float], cached: int, prompt: int, hits: int) -> dict[str, float]:
    return {
        "requests": len(ttfts_ms),
        "ttft_p50_ms": percentile(ttfts_ms, 50),
        "ttft_p99_ms": percentile(ttfts_ms, 99),
        "ttft_mean_ms": statistics.fmean(ttfts_ms) if ttfts_ms else math.nan,
        "hit_rate": cached / (prompt or 1),
        "requests_hit_share": hits / (len(ttfts_ms) or 1),
    }


def measured(capture: Capture, warm_n: int) -> dict[str, dict[str, float]]:
    """The gateway's view of a run (its capture) after its first `warm_n` arrivals: the TTFT
    it observed (first byte from the replica, cachelane_ttft_seconds) and the engines' cached
    tokens."""
    out: dict[str, dict[str, float]] = {}
    counted = sorted(capture.requests, key=lambda r: r.t_s)[warm_n:]
    groups: dict[str, list[CapturedRequest]] = {ALL: counted}
    for r in counted:
        groups.setdefault(r.tenant_class, []).append(r)
    for name, rows in groups.items():
        timed = [r for r in rows if r.ttft_s is not None]
        out[name] = _stats(
            [r.ttft_s * 1000 for r in timed if r.ttft_s is not None],
            sum(r.cached_tokens or 0 for r in timed),
            sum(r.prompt_tokens for r in timed),
            sum(1 for r in timed if (r.cached_tokens or 0) >= r.prompt_tokens // 2),
        )
    return out


def predicted(capture: Capture, setup: Setup, warm_n: int) -> dict[str, dict[str, float]]:
    outcome = plan_replay(capture.requests, setup, seed=SEED)
    counted = sorted(outcome.requests, key=lambda r: r.arrived_s)[warm_n:]
    groups: dict[str, list[Replayed]] = {ALL: counted}
    for r in counted:
        groups.setdefault(r.tenant_class, []).append(r)
    return {
        name: _stats(
            [r.ttft_s * 1000 for r in rows],
            sum(r.hbm_tokens + r.cpu_tokens + r.remote_tokens for r in rows),
            sum(r.prompt_tokens for r in rows),
            sum(
                1
                for r in rows
                if r.hbm_tokens + r.cpu_tokens + r.remote_tokens >= r.prompt_tokens // 2
            ),
        )
        for name, rows in groups.items()
    }


def error(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else float("nan")


def rows_of(payload: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for setup in SETUPS:
        entry = payload["setups"].get(setup)
        if entry is None:
            continue
        for group in ("critical", "standard", ALL):
            m = entry["measured"].get(group)
            p = entry["predicted_whatif"].get(group)
            s = entry["predicted_same"].get(group)
            if m is None or p is None or s is None:
                continue
            row: dict[str, Any] = {"setup": setup, "class": group}
            for metric in METRICS:
                row[metric] = {
                    "measured": m[metric],
                    "whatif": p[metric],
                    "same": s[metric],
                    "whatif_error": error(p[metric], m[metric]),
                    "same_error": error(s[metric], m[metric]),
                }
            rows.append(row)
    return rows


def markdown_table(rows: list[dict[str, Any]], kind: str) -> str:
    """`kind`: "whatif" (predicted from the HBM-only capture) or "same" (from the run's own)."""
    head = ["set-up", "class"]
    for metric in METRICS:
        head += [f"{LABELS[metric]} measured", "predicted (error)"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * (2 * len(METRICS))]
    for row in rows:
        cells = [row["setup"], row["class"]]
        for metric in METRICS:
            v = row[metric]
            fmt = "{:.0f}" if metric.endswith("_ms") else "{:.1%}"
            err = v[f"{kind}_error"]
            mark = "" if abs(err) <= GOAL else " **x**"
            cells += [fmt.format(v["measured"]), f"{fmt.format(v[kind])} ({err:+.0%}){mark}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = harness.parser(
        "plan_validation",
        "The planner's prediction vs the simulated fleet, for three set-ups.",
        quick=f"{QUICK_DURATION_S:.0f} s per set-up",
    )
    p.add_argument("--duration-s", type=float, default=None, help=f"(default {DURATION_S:.0f})")
    p.add_argument("--out", type=Path, default=OUT_JSON, help="(default: %(default)s)")
    p.add_argument("--log-dir", type=Path, default=Path("results/plan_validation"))
    p.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        help="the fleet's prefill, PCIe and network this many times slower than the defaults "
        "(request rates unchanged; default 1: TTFTs of a few ms, which this machine's jitter "
        "dominates)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    duration_s = args.duration_s or (QUICK_DURATION_S if args.quick else DURATION_S)
    console = Console()
    voice = tier_traces.voice(VOICE_RATE_PER_S, duration_s, SEED)
    web = tier_traces.reuse("high", WEB_RATE_PER_S, duration_s, SEED)
    console.print(
        f"{len(voice)} voice + {len(web)} web requests over {duration_s:.0f} s per set-up"
    )
    payload: dict[str, Any] = {
        "duration_s": duration_s,
        "replicas": REPLICAS,
        "hbm_tokens": HBM_TOKENS,
        "cpu_tokens": CPU_TOKENS,
        "remote_tokens": REMOTE_TOKENS,
        "slowdown": args.slowdown,
        "setups": {},
    }
    warm_n = sum(1 for r in [*voice, *web] if r["t_s"] < WARMUP_S)
    captures: dict[str, Capture] = {}
    lookup_s = 0.0
    started = time.perf_counter()
    with sigterm_as_interrupt():
        for setup in SETUPS:
            results, path, probed = run_setup(setup, voice, web, args.log_dir, args.slowdown)
            lookup_s = probed if probed is not None else lookup_s
            captures[setup] = read_capture(path)
            payload["setups"][setup] = {
                "captured_requests": len(captures[setup].requests),
                "measured": measured(captures[setup], warm_n),
                "client": client_measured(results),
            }
            console.print(f"{setup}: ran, {len(captures[setup].requests)} requests captured")
    base = Setup.from_capture(captures["hbm"])
    payload["fit"] = {k: list(v.as_vector()) for k, v in base.terms.items()}
    payload["remote_lookup_probe_ms"] = lookup_s * 1000
    for setup in SETUPS:
        entry = payload["setups"][setup]
        entry["predicted_whatif"] = predicted(
            captures["hbm"], predicted_setup(base, setup, lookup_s), warm_n
        )
        entry["predicted_whatif_no_lookup"] = predicted(
            captures["hbm"], predicted_setup(base, setup), warm_n
        )
        own = Setup.from_capture(captures[setup])
        entry["predicted_same"] = predicted(captures[setup], own, warm_n)
    payload["rows"] = rows_of(payload)
    payload["elapsed_s"] = time.perf_counter() - started
    console.print("\nPredicted from the HBM-only capture (what-if):\n")
    print(markdown_table(payload["rows"], "whatif"))
    console.print("\nPredicted from each run's own capture (same set-up):\n")
    print(markdown_table(payload["rows"], "same"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
