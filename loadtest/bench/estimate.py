"""How true is the gateway's TTFT estimate when the fleet is slower than the gateway believes?

    python -m loadtest.bench.estimate [--quick] [--speeds 3,10] [--modes none,correction,fit]

For each speed s, one simulated fleet (4 replicas with a small HBM tier, a CPU tier and one shared
remote tier) whose costs are s times slower than routing/cost.py's defaults: prefill, PCIe and the
remote network all divided by s (the remote tier's fixed cost per fetch stays). Each arm is a fresh
gateway on that fleet with the same pool topology but no `costs` block (it starts from the
defaults, as a user who does not know their GPU's prefill rate would) and `routing.calibration`
set to the arm's mode; arm `true` states the sim's real costs and step budget with calibration
`none` (the reference for routing quality). Before each arm every replica's prefix cache and the
remote tier are emptied, and the same seeded trace (multi-turn chat and RAG questions about shared
documents) is replayed open-loop.

Per request, from the client's side: the gateway's estimate (x-cachelane-est-ttft-ms) against the
observed time to the first SSE chunk, as |est - obs| / obs. Reported: p50 / p90 of that error over
the first 50 requests (while calibration learns) and over the rest; the goal figure, its p90 over
the requests after the first 50 whose TTFT is >= 50 ms; est / obs p50 (the bias); the estimate
without its load term against the observed TTFT without the sims' own KV load time (the sims run
vLLM V1's step loop by default, where a request's wait and its prefill spread over shared steps,
so the queue term alone has no observed counterpart); the prefix hit rate from the usage chunks,
client TTFT p50 / p99, the prefill utilisation the sims saw (tokens computed and each step's
fixed cost), and how the prompt tokens split over HBM / CPU / remote / computed. Per arm also:
the goal figure with the observed time outside the sims' engines (client, gateway and HTTP hops:
the TTFT less the sim's own arrival-to-first-token time) in place of the estimate's terms for
it, which tells a miss of the engine terms from the machine's load; and the goal figure with
the sims' own KV load time, their time from the load to the first token (the queue and the
prefill's steps), or both, in place of the estimate's terms for them, which says which term's
misses the goal figure is made of.

Prints a table, writes results/bench_estimate.json and results/bench_estimate.png (rolling p90
of the error over the request index, one line per arm, one panel per speed). The machine's cores
are shared by the sims, the gateway and this client: compare arms within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich import box
from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from loadtest.bench import figures, harness
from loadtest.bench.estimate_oracle import (
    SimTimes,
    best_scaled_p90,
    oracle_errors,
    replay_errors,
    replay_replicas,
)
from loadtest.bench.processes import (
    free_port,
    gateway_from_config,
    loopback_urls,
    sim_from_config,
)
from loadtest.bench.replay import PATHS, REPLICA_HEADER, at_offsets, request_body, sse_data
from loadtest.bench.tier_experiment import ReuseSetup, scrape
from loadtest.sim.config import ITL_S, SIM_MODEL
from loadtest.sim.protocol import SIM_TIMING_KEY
from loadtest.sim.steps import StepSettings, default_max_num_batched_tokens
from loadtest.sim.tiny_tokenizer import BOS, EOS, TinyTokenizerFiles, write_tiny_tokenizer
from loadtest.workloads import traces
from loadtest.workloads.traces import TraceRecord
from routing.cost import (
    PCIE_GBPS,
    PREFILL_TOKENS_PER_S,
    REMOTE_GBPS,
    Load,
    Overlap,
    PoolCosts,
    estimate,
)
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS
from routing.prompt import approx_tokens
from routing.whatif.summary import percentile

EST_HEADER = "x-cachelane-est-ttft-ms"
JSON_HEADERS = {"content-type": "application/json"}
TERMS_HEADER = "x-cachelane-est-terms-ms"
EXPECTED_HEADER = "x-cachelane-expected-cached-tokens"
TIERS_HEADER = "x-cachelane-expected-tiers"

SPEEDS = (3.0, 10.0)
MODES = ("none", "correction", "fit")  # routing.calibration
TRUE_ARM = "true"  # the sim's real costs in the gateway config, calibration none

DURATION_S = 30.0
QUICK_DURATION_S = 4.0
# 30 s arms: ~300 requests at the rate below (so ~250 "after the first 50"); 2 speeds x 4 arms plus
# ~3 s of start-up and drain each is ~4.5 minutes. --quick checks the machinery only.

FIRST_N = 50  # "while calibrating": the first 50 requests of an arm; the rest are "after"
GOAL_MIN_TTFT_S = 0.050
GOAL_P90 = 0.25
# The estimate's goal: on the step engine, with no constants given, p90 |est - obs| / obs <= 25%
# over the requests after the first 50 whose observed TTFT is >= 50 ms (below it the fixed term
# dominates).
ROLLING_WINDOW = 25  # requests per point of the plot's rolling p90

WEIGHTS: dict[str, float] = {"chat": 0.5, "rag": 0.5}
# Multi-turn chat (8 apps' system prompts, conversations growing turn by turn) and questions about
# 80 shared documents (Zipf popularity): long shared prefixes that outgrow HBM (evicted to the CPU
# tier, then out of it, found again in the remote tier) next to hot ones that stay in HBM.
MAX_TOKENS = 16  # TTFT is the subject; short answers keep the client's CPU cost low

TARGET_UTILISATION = 0.65
MISS_FACTOR = 1.2
PROBE_RATE_PER_S = 10.0
PROBE_DURATION_S = 20.0
MIN_RATE_PER_S = 2.0
MAX_RATE_PER_S = 16.0
# The trace's rate is set so that prefill is moderately busy at the slowest speed asked for:
#   utilisation = uncached tokens per second / (replicas * PREFILL_TOKENS_PER_S / speed).
# Uncached tokens per request come from a 20 s probe trace of this mix: its ideal misses
# (traces.ideal_hits: one unlimited shared cache; ~650 of ~2.3k prompt tokens per request) times
# MISS_FACTOR for what a real fleet loses on top (evictions whose blocks the remote tier did not
# keep, remote hits cheaper to recompute, concurrent first requests for one prefix): ~780. At
# speed 10 the fleet prefills 4 x 3k = 12k tokens/s, and 0.65 of it is ~7.8k tokens/s: ~10 req/s,
# ~300 requests per 30 s arm; the sims measured 0.51-0.58 at 0.6 (reported per arm as `util`).
# At speed 3 the same trace uses ~0.2 of the fleet. Remote fetches and swap-ins do not hold the
# prefill lock, so they are not counted. Smaller prompts are not an option without forking
# loadtest/workloads/traces.py's sizes, hence the longer arms. MAX_RATE_PER_S bounds what two
# shared cores drive through one gateway (a single fast speed would otherwise ask for ~40 req/s).

MAX_IN_FLIGHT = 256  # far above rate x latency; only stops a runaway
DRAIN_TIMEOUT_S = 30.0  # after the last arrival, how long stragglers may take before cancellation
CONNECT_TIMEOUT_S = 5.0
HTTP_TIMEOUT_S = 5.0  # one reset on loopback

SIM_COUNTERS = (
    "vllm:prompt_tokens",
    "vllm:prefix_cache_hits",
    "cachelane_sim_swap_in_tokens",
    "cachelane_sim_remote_fetch_tokens",
    "cachelane_sim_steps",
)


@dataclass(frozen=True, slots=True)
class Setup(ReuseSetup):
    # tier_experiment.ReuseSetup's fleet: 4 x (12k + 8k) = 80k tokens of HBM and CPU against ~10-20
    # live conversations of 1-7k tokens each and ~160k tokens of documents, so prefixes move
    # HBM -> CPU -> out, and a later turn or question finds them in HBM, the CPU or the remote tier.
    token_inflation: float = 1.0
    # Capacities are in the workload's own token counts (routing.prompt.approx_tokens); with a real
    # tokenizer (precise mode) they are scaled by how many more tokens it makes of the same text.


@dataclass(frozen=True, slots=True)
class Precise:
    """Precise mode: the tokenizer both sides use, and each replica's KV event port."""

    tokenizer: TinyTokenizerFiles
    event_ports: tuple[int, ...]

    def pool_keys(self, replicas: Sequence[str]) -> dict[str, Any]:
        t = self.tokenizer
        return {
            "kv_events": {
                "endpoints": {
                    url: f"tcp://127.0.0.1:{port}"
                    for url, port in zip(replicas, self.event_ports, strict=True)
                }
            },
            "tokenizer": {
                "path": str(t.tokenizer_json),
                "chat_template": str(t.chat_template),
                "bos_token": BOS,
                "eos_token": EOS,
            },
        }


def token_inflation(trace: Sequence[TraceRecord], tokenizer: TinyTokenizerFiles) -> float:
    """Tokens the tokenizer makes of the trace's prompts / the workload's own count of them."""
    tok = Tokenizer.from_file(str(tokenizer.tokenizer_json))
    texts = [traces.prompt_text(r) for r in trace]
    real = sum(len(e.ids) for e in tok.encode_batch(texts))
    return real / max(1, sum(approx_tokens(t) for t in texts))


def sim_costs(speed: float) -> dict[str, float]:
    """routing/cost.py's defaults, every rate divided by `speed` (the fixed remote cost stays)."""
    return {
        "prefill_tokens_per_s": PREFILL_TOKENS_PER_S / speed,
        "pcie_gbps": PCIE_GBPS / speed,
        "remote_gbps": REMOTE_GBPS / speed,
    }


def sim_steps(speed: float) -> StepSettings:
    """The sims' step loop at `speed`: vLLM's defaults, the budget scaled to their prefill rate
    (loadtest/sim/steps.py), a decode step of the sims' default ITL; sim_config passes them no
    other engine flag."""
    rate = PREFILL_TOKENS_PER_S / speed
    return StepSettings(
        prefill_tokens_per_s=rate,
        max_num_batched_tokens=default_max_num_batched_tokens(rate),
        decode_step_s=ITL_S,
    )


def fleet_config(
    setup: Setup,
    replicas: Sequence[str],
    remote: str,
    *,
    calibration: str,
    costs: bool,
    speed: float,
    precise: Precise | None = None,
) -> dict[str, Any]:
    """One config for both sides: the sims read `costs` and `sim`, the gateway the rest. Without
    `costs` the pool has routing/cost.py's defaults."""
    f = setup.token_inflation
    pool: dict[str, Any] = {
        "name": "fleet",
        "replicas": list(replicas),
        "models": [SIM_MODEL],
        "hbm_capacity_tokens": round(setup.hbm_capacity_tokens * f),
        "cpu_capacity_tokens": round(setup.cpu_capacity_tokens * f),
        "remote_tier": "kv",
    }
    if costs:
        pool["costs"] = sim_costs(speed)
        pool["engine"] = {"max_num_batched_tokens": sim_steps(speed).max_num_batched_tokens}
    routing: dict[str, Any] = {"calibration": calibration}
    if precise is not None:
        pool |= precise.pool_keys(replicas)
        routing["mode"] = "precise"
    return {
        "routing": routing,
        "remote_tiers": [{"name": "kv", "url": remote}],
        "pools": [pool],
    }


def sim_config(
    setup: Setup, replicas: Sequence[str], remote: str, speed: float, precise: Precise | None
) -> dict[str, Any]:
    config = fleet_config(
        setup, replicas, remote, calibration="none", costs=True, speed=speed, precise=precise
    )
    config["pools"][0]["sim"] = {"time_factor": 1.0}  # real time: the client measures wall clock
    return config


def gateway_config(
    setup: Setup,
    replicas: Sequence[str],
    remote: str,
    arm: str,
    speed: float,
    precise: Precise | None,
) -> dict[str, Any]:
    true = arm == TRUE_ARM
    return fleet_config(
        setup,
        replicas,
        remote,
        calibration="none" if true else arm,
        costs=true,
        speed=speed,
        precise=precise,
    )


# --- trace -----------------------------------------------------------------------------------


def _trace(
    rate_per_s: float, duration_s: float, seed: int, slowest: float, token_inflation: float = 1.0
) -> list[TraceRecord]:
    # The next turn of a conversation starts after a conservative bound on the previous one's
    # service time at the slowest speed (the whole prompt prefilled, twice the sim's ITL).
    bound = traces.ServiceBound(
        prefill_tokens_per_s=PREFILL_TOKENS_PER_S / slowest / token_inflation, itl_s=2 * ITL_S
    )
    return traces.generate(
        WEIGHTS,
        rate_per_s=rate_per_s,
        duration_s=duration_s,
        seed=seed,
        max_tokens=MAX_TOKENS,
        bound=bound,
    )


def uncached_per_request(trace: Sequence[TraceRecord], token_inflation: float = 1.0) -> float:
    hits = traces.ideal_hits(trace)
    missed = hits.prompt_tokens - hits.cached_tokens
    return MISS_FACTOR * token_inflation * missed / max(1, len(trace))


def fleet_prefill_tokens_per_s(setup: Setup, speed: float) -> float:
    return setup.replicas * PREFILL_TOKENS_PER_S / speed


def pick_rate(setup: Setup, slowest: float, seed: int) -> float:
    f = setup.token_inflation
    probe = _trace(PROBE_RATE_PER_S, PROBE_DURATION_S, seed, slowest, f)
    rate = (
        TARGET_UTILISATION
        * fleet_prefill_tokens_per_s(setup, slowest)
        / uncached_per_request(probe, f)
    )
    return round(min(MAX_RATE_PER_S, max(MIN_RATE_PER_S, rate)), 2)


# --- open-loop sender ------------------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    index: int
    scheduled_s: float
    send_lag_s: float = 0.0
    status: int = 0
    obs_s: float | None = None  # client time to the first SSE chunk
    est_s: float | None = None  # the gateway's x-cachelane-est-ttft-ms, in seconds
    e2e_s: float | None = None
    replica: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    expected_cached_tokens: int = 0  # what the gateway's index expected the engine to reuse
    est_terms_ms: dict[str, float] = field(default_factory=dict)  # x-cachelane-est-terms-ms
    expected_tiers: dict[str, float] = field(default_factory=dict)  # x-cachelane-expected-tiers
    sim: dict[str, float] = field(default_factory=dict)  # the sim's usage extension
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def rel_error(self) -> float | None:
        if not self.ok or self.obs_s is None or self.est_s is None or self.obs_s <= 0:
            return None
        return abs(self.est_s - self.obs_s) / self.obs_s


def _terms(header: str) -> dict[str, float]:
    """ "fixed=3.0,load=0.0,queue=12.5,prefill=40.1" -> {"fixed": 3.0, ...}"""
    out = {}
    for part in header.split(","):
        name, _, value = part.partition("=")
        if value:
            out[name.strip()] = float(value)
    return out


async def _send(client: aiohttp.ClientSession, record: TraceRecord, s: Sample) -> None:
    body = json.dumps(request_body(record, SIM_MODEL)).encode()
    started = time.perf_counter()
    path = PATHS[record["endpoint"]]
    async with client.post(path, data=body, headers=JSON_HEADERS) as resp:
        s.status = resp.status
        s.replica = resp.headers.get(REPLICA_HEADER, "")
        est = resp.headers.get(EST_HEADER)
        s.est_s = float(est) / 1000 if est else None
        s.est_terms_ms = _terms(resp.headers.get(TERMS_HEADER, ""))
        s.expected_cached_tokens = int(resp.headers.get(EXPECTED_HEADER) or 0)
        s.expected_tiers = _terms(resp.headers.get(TIERS_HEADER, ""))
        if resp.status != 200:
            text = (await resp.read()).decode(errors="replace")
            s.error = f"HTTP {resp.status}: {text[:300]}"
            return
        async for chunk in sse_data(resp.content):
            if s.obs_s is None:
                s.obs_s = time.perf_counter() - started
            if "error" in chunk:
                s.error = f"stream error: {str(chunk['error'])[:300]}"
                break
            usage = chunk.get("usage")
            if usage:
                s.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                details = usage.get("prompt_tokens_details") or {}
                s.cached_tokens = int(details.get("cached_tokens") or 0)
                s.sim = usage.get(SIM_TIMING_KEY) or {}
    s.e2e_s = time.perf_counter() - started
    if s.error is None and not s.prompt_tokens:
        s.error = "no usage chunk in the stream"
    if s.error is None and s.est_s is None:
        s.error = f"no {EST_HEADER} header"


GATEWAY_ERROR = "cachelane_ttft_estimate_error_ratio"
WITHIN = "0.2"  # the goal: p90 of |est - obs| / obs <= 20%, i.e. 90% within 0.2


async def gateway_error_counts(client: aiohttp.ClientSession) -> tuple[float, float]:
    """(requests within 20%, requests) of the gateway's own estimate-error histogram: its
    estimate against the TTFT it observed (sent to first byte from the replica), summed over
    replicas; the client's TTFT adds the gateway before sending and the way back."""
    within = total = 0.0
    async with client.get("/metrics") as resp:
        exposition = await resp.text()
    for family in text_string_to_metric_families(exposition):
        if family.name != GATEWAY_ERROR:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels.get("le") == WITHIN:
                within += sample.value
            elif sample.name.endswith("_count"):
                total += sample.value
    return within, total


async def send_trace(
    trace: Sequence[TraceRecord], base_url: str
) -> tuple[list[Sample], float, dict[str, float]]:
    """Every record at its arrival offset (open loop, at most MAX_IN_FLIGHT at once); whatever is
    still running DRAIN_TIMEOUT_S after the last arrival is cancelled. Returns the samples in
    trace order, the elapsed time, and the gateway's own share of estimates within 20% after
    the first FIRST_N requests ended (its histogram read then and at the end)."""
    samples = [Sample(i, r["t_s"]) for i, r in enumerate(trace)]
    slots = asyncio.Semaphore(MAX_IN_FLIGHT)
    # aiohttp, not httpx: the client's own cost is part of every observed TTFT, and httpx's is
    # ~1.7 ms more per streamed request on loopback (a tenth of a 15 ms HBM hit)
    connector = aiohttp.TCPConnector(limit=MAX_IN_FLIGHT)
    timeout = aiohttp.ClientTimeout(sock_connect=CONNECT_TIMEOUT_S, sock_read=DRAIN_TIMEOUT_S)
    async with aiohttp.ClientSession(
        base_url=base_url, connector=connector, timeout=timeout, trust_env=False
    ) as client:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        done = 0
        warm: asyncio.Task[tuple[float, float]] | None = None

        async def one(i: int, record: TraceRecord, due_s: float) -> None:
            nonlocal done, warm
            s = samples[i]
            try:
                async with slots:
                    s.send_lag_s = max(0.0, loop.time() - due_s)
                    await _send(client, record, s)
            except asyncio.CancelledError:
                s.error = "cancelled at the drain deadline"
                raise
            except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, ValueError) as err:
                s.error = f"{type(err).__name__}: {err}"
            done += 1
            if done == FIRST_N:
                warm = asyncio.create_task(gateway_error_counts(client))

        await at_offsets(trace, one, drain_timeout_s=DRAIN_TIMEOUT_S)
        elapsed_s = loop.time() - t0
        within, total = await gateway_error_counts(client)
        within_first, total_first = await warm if warm is not None else (0.0, 0.0)
        after = total - total_first
        gateway = {
            "requests_after": after,
            "within_20_after": (within - within_first) / after if after else math.nan,
        }
        return samples, elapsed_s, gateway


# --- one arm ---------------------------------------------------------------------------------


@dataclass
class ArmResult:
    arm: str
    speed: float
    samples: list[Sample]
    elapsed_s: float
    sims: dict[str, float]  # the sims' counters, summed over replicas, grown during the arm
    prefill_tokens_per_s: float  # one replica's real rate
    replicas: int
    gateway: dict[str, float] = field(default_factory=dict)  # its own estimate error, after
    stats: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.stats = arm_stats(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.stats,
            "sims": self.sims,
            "elapsed_s": self.elapsed_s,
            "per_request": {
                "sent_ms": [_ms(s.scheduled_s + s.send_lag_s) for s in self.samples],
                "e2e_ms": [_ms(s.e2e_s) for s in self.samples],
                "est_ms": [_ms(s.est_s) for s in self.samples],
                "obs_ms": [_ms(s.obs_s) for s in self.samples],
                "rel_error": [s.rel_error for s in self.samples],
                "replica": [s.replica for s in self.samples],
                "cached_tokens": [s.cached_tokens for s in self.samples],
                "prompt_tokens": [s.prompt_tokens for s in self.samples],
                "expected_cached_tokens": [s.expected_cached_tokens for s in self.samples],
                "est_terms_ms": [s.est_terms_ms for s in self.samples],
                "expected_tiers": [s.expected_tiers for s in self.samples],
                "sim": [s.sim for s in self.samples],
            },
            "errors_seen": sorted({s.error for s in self.samples if s.error})[:5],
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _errors(samples: Sequence[Sample]) -> list[float]:
    return [e for e in (s.rel_error for s in samples) if e is not None]


FIXED_ONLY_TOKENS = 100  # computed tokens below which a request's prefill is a few ms at most
FIXED_ONLY_WAIT_MS = 1.0
FLOOR_GRID = 400  # the best single estimate is searched over the observed values and this grid


def fixed_only(samples: Sequence[Sample]) -> list[float]:
    """Observed TTFTs (s) of the requests whose cost, by the sim's own report, was the fixed
    overhead alone: all of the prompt in HBM but under FIXED_ONLY_TOKENS, no swap-in, no fetch,
    no wait for the prefill. Every cost model gives them one figure, its fixed term."""
    return [
        s.obs_s
        for s in samples
        if s.ok
        and s.obs_s
        and s.sim.get("computed_tokens", math.inf) < FIXED_ONLY_TOKENS
        and not s.sim.get("cpu_tokens")
        and not s.sim.get("remote_tokens")
        and s.sim.get("queue_wait_ms", math.inf) < FIXED_ONLY_WAIT_MS
    ]


def error_floor(fixed_obs: Sequence[float], share: float) -> float:
    """A floor under the p90 of |est - obs| / obs that a model with a fixed term can reach on
    this run: the requests in `fixed_obs` (a `share` of all) get one estimate c, so at least
    share x (1 - q) of all requests are off by more than their q-quantile error at the best c,
    and the overall p90 is at least the quantile q = 1 - 0.1 / share. NaN when they are too
    few to bound it (share <= 10%)."""
    if share <= 0.1 or not fixed_obs:
        return math.nan
    q = 100 * (1 - 0.1 / share)
    lo, hi = min(fixed_obs), max(fixed_obs)
    grid = [*fixed_obs, *(lo + (hi - lo) * k / FLOOR_GRID for k in range(FLOOR_GRID + 1))]
    return min(percentile([abs(c - o) / o for o in fixed_obs], q) for c in grid)


OUTSIDE_TERMS = ("gateway", "fixed", "relay")  # x-cachelane-est-terms-ms outside the engine


def outside_engine(samples: Sequence[Sample]) -> tuple[list[float], list[float]]:
    """Over the goal's requests: the wall time outside the sim's engine (observed TTFT less the
    sim's own arrival-to-first-token phase: the client, the gateway, both HTTP hops; the machine's
    load shows here first), and each request's error with that observed time in place of the
    estimate's own terms for it (what the error would be if the engine terms alone missed)."""
    outside: list[float] = []
    errors: list[float] = []
    for s in samples:
        first_ms = s.sim.get("first_token_ms")
        if not s.ok or not s.obs_s or s.est_s is None or first_ms is None:
            continue
        obs_ms = s.obs_s * 1000
        out_ms = obs_ms - first_ms
        est_ms = s.est_s * 1000 - sum(s.est_terms_ms.get(t, 0.0) for t in OUTSIDE_TERMS) + out_ms
        outside.append(out_ms)
        errors.append(abs(est_ms - obs_ms) / obs_ms)
    return outside, errors


SIM_PHASES = {
    # what the sim reports a phase took (ms from its own timestamps), for the estimate's terms
    "load": (("load",), "located_ms", "loaded_ms"),  # swap-in and fetch
    "wait": (("queue", "prefill"), "loaded_ms", "first_token_ms"),  # steps to its first token
}


def with_sim_phases(samples: Sequence[Sample], phases: Sequence[str]) -> list[float]:
    """Each request's |est - obs| / obs with the sim's own time for each of `phases` (SIM_PHASES)
    in place of the estimate's terms for it: how far the estimate would be off if only the
    other terms missed, which attributes the misses to the terms. Requests without the sim's
    report are left out."""
    errors: list[float] = []
    for s in samples:
        if not s.ok or not s.obs_s or s.est_s is None:
            continue
        est_ms = s.est_s * 1000
        for phase in phases:
            terms, start, end = SIM_PHASES[phase]
            if start not in s.sim or end not in s.sim:
                break
            est_ms += s.sim[end] - s.sim[start] - sum(s.est_terms_ms.get(t, 0.0) for t in terms)
        else:
            errors.append(abs(est_ms - s.obs_s * 1000) / (s.obs_s * 1000))
    return errors


def sim_pool_costs(speed: float) -> PoolCosts:
    """The costs the sims charge at `speed` (sim_costs over routing/cost.py's defaults)."""
    c = sim_costs(speed)
    return PoolCosts(
        prefill_tokens_per_s=c["prefill_tokens_per_s"],
        pcie_gbps=c["pcie_gbps"],
        remote_gbps=c["remote_gbps"],
    )


def sim_load_ms(s: Sample, costs: PoolCosts) -> float | None:
    """How long the sim loaded the request's KV (CPU swap-in, remote fetch) before it could be
    scheduled: the routing.cost.estimate() swap and fetch terms the sim sleeps for
    (loadtest/sim/engine.py), from the usage it reported. None without that report."""
    if not s.sim or not s.prompt_tokens:
        return None
    overlap = Overlap(
        s.prompt_tokens,
        hbm_tokens=int(s.sim.get("hbm_tokens", 0)),
        cpu_tokens=int(s.sim.get("cpu_tokens", 0)),
        remote_tokens=int(s.sim.get("remote_tokens", 0)),
    )
    sharing = max(0, int(s.sim.get("swap_sharers", 0)) - 1)  # the others on the link
    return 1000 * estimate(overlap, Load(swaps_in_flight=sharing), costs).load_s


def future_floor(arm: ArmResult, goal_samples: Sequence[Sample]) -> dict[str, Any]:
    """The goal figure of an oracle that knows each replica's state as a request arrives but not
    what arrives after it (loadtest/bench/estimate_oracle.py), on the same requests."""
    times = [
        t
        for s in arm.samples
        if s.ok and (t := SimTimes.from_usage(s.index, s.replica, s.sim)) is not None
    ]
    replayed = replay_replicas(times, sim_steps(arm.speed))
    observed = {s.index: s.obs_s * 1000 for s in goal_samples if s.ok and s.obs_s}
    scale, scaled_p90 = best_scaled_p90(replayed, observed)
    return {
        "err_p90_after_goal_no_future": percentile(oracle_errors(replayed, observed), 90),
        "err_p90_after_goal_no_future_best_scale": scaled_p90,
        "no_future_best_scale": scale,
        "replay_err_p90_after_goal": percentile(replay_errors(replayed, observed), 90),
        "n_replayed_goal": sum(1 for i in observed if i in replayed),
    }


TIERS = ("hbm", "cpu", "remote")


def tiers_as_sims(samples: Sequence[Sample]) -> list[int]:
    """[requests whose expected HBM / CPU / remote split (x-cachelane-expected-tiers) is, block
    for block, where the sim found the prompt on arrival, requests compared]: how well the
    gateway's index follows the engines' caches (its recorded tiers against theirs)."""
    block = DEFAULT_BLOCK_SIZE_TOKENS  # the sims and the gateway here
    pairs = [
        [
            (int(s.expected_tiers.get(t, 0)) // block, int(s.sim.get(f"{t}_tokens", 0)) // block)
            for t in TIERS
        ]
        for s in samples
        if s.ok and s.expected_tiers and s.sim
    ]
    return [sum(all(a == b for a, b in p) for p in pairs), len(pairs)]


def arm_stats(arm: ArmResult) -> dict[str, Any]:
    ok = [s for s in arm.samples if s.ok]
    first, after = _errors(arm.samples[:FIRST_N]), _errors(arm.samples[FIRST_N:])
    prompt = sum(s.prompt_tokens for s in ok)
    cached = sum(s.cached_tokens for s in ok)
    obs_ms = [s.obs_s * 1000 for s in ok if s.obs_s is not None]
    ratios = [s.est_s / s.obs_s for s in ok if s.est_s is not None and s.obs_s]
    sim_prompt = arm.sims.get("vllm:prompt_tokens", 0.0)
    hbm = arm.sims.get("vllm:prefix_cache_hits", 0.0)
    cpu = arm.sims.get("cachelane_sim_swap_in_tokens", 0.0)
    remote = arm.sims.get("cachelane_sim_remote_fetch_tokens", 0.0)
    computed = max(0.0, sim_prompt - hbm - cpu - remote)
    # A step costs its fixed part plus its tokens (loadtest/sim/steps.py).
    busy_s = computed / arm.prefill_tokens_per_s + arm.sims.get("cachelane_sim_steps", 0.0) * (
        sim_steps(arm.speed).step_overhead_s
    )
    span_s = max(1e-9, max((s.scheduled_s for s in arm.samples), default=0.0))

    def share(tokens: float) -> float:
        return tokens / sim_prompt if sim_prompt else math.nan

    # Everything but the KV load, after the first FIRST_N: on the step engine a request's wait
    # and its prefill spread over shared steps, so the estimate without its load term is set
    # against the observed TTFT without the sim's own load time (sim_load_ms).
    costs = sim_pool_costs(arm.speed)
    waited = [
        (s.est_s * 1000 - s.est_terms_ms.get("load", 0.0), s.obs_s * 1000 - load, s.obs_s * 1000)
        for s in arm.samples[FIRST_N:]
        if s.ok and s.obs_s and s.est_s is not None and (load := sim_load_ms(s, costs)) is not None
    ]
    goal_samples = [s for s in arm.samples[FIRST_N:] if (s.obs_s or 0.0) >= GOAL_MIN_TTFT_S]
    goal = _errors(goal_samples)
    outside_ms, engine_errors = outside_engine(goal_samples)
    after_ok = [s for s in arm.samples[FIRST_N:] if s.ok and s.rel_error is not None]
    fixed_obs = fixed_only(after_ok)
    no_future = future_floor(arm, goal_samples)
    fixed_share = len(fixed_obs) / len(after_ok) if after_ok else 0.0
    return {
        "requests": len(arm.samples),
        "ok": len(ok),
        "gateway_within_20_after": arm.gateway.get("within_20_after", math.nan),
        "fixed_only_share": fixed_share,
        "fixed_only_ttft_p10_p50_p90_ms": [percentile(fixed_obs, q) * 1000 for q in (10, 50, 90)]
        if fixed_obs
        else [],
        "err_p90_floor": error_floor(fixed_obs, fixed_share),
        "errors": len(arm.samples) - len(ok),
        "err_p50_first": percentile(first, 50),
        "err_p90_first": percentile(first, 90),
        "err_p50_after": percentile(after, 50),
        "err_p90_after": percentile(after, 90),
        "n_first": len(first),
        "n_after": len(after),
        "est_over_obs_p50": percentile(ratios, 50),
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_ms": percentile(obs_ms, 50),
        "ttft_p99_ms": percentile(obs_ms, 99),
        "err_p90_after_goal": percentile(goal, 90),
        "n_after_goal": len(goal),
        "outside_engine_ms_p50_p90": [percentile(outside_ms, q) for q in (50, 90)]
        if outside_ms
        else [],
        "err_p90_after_goal_engine_terms": percentile(engine_errors, 90),
        # the goal with the sims' own load time, steps to the first token, or both, in place of
        # the estimate's terms for them: which term's misses the goal figure is made of
        **{
            f"err_p90_after_goal_sim_{'_'.join(p)}": percentile(
                with_sim_phases(goal_samples, p), 90
            )
            for p in (("load",), ("wait",), ("load", "wait"))
        },
        **no_future,
        "after_load_est_ms_mean": statistics.fmean([w[0] for w in waited]) if waited else math.nan,
        "after_load_obs_ms_mean": statistics.fmean([w[1] for w in waited]) if waited else math.nan,
        "after_load_err_p90_after": percentile([abs(e - w) / o for e, w, o in waited], 90),
        "send_lag_p99_ms": percentile([s.send_lag_s * 1000 for s in arm.samples], 99),
        "tiers_as_sims": tiers_as_sims(arm.samples),
        "prefill_utilisation": busy_s / (arm.replicas * span_s),
        "tier_share": {
            "hbm": share(hbm),
            "cpu": share(cpu),
            "remote": share(remote),
            "computed": share(computed),
        },
    }


def reset(replicas: Sequence[str], remote: str) -> None:
    """Empty every replica's prefix cache and the remote tier, so arms start alike."""
    with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
        for url in replicas:
            client.post(f"{url}/reset_prefix_cache").raise_for_status()
        client.post(f"{remote}/reset").raise_for_status()


def run_speed(
    console: Console,
    setup: Setup,
    speed: float,
    arms: Sequence[str],
    trace: Sequence[TraceRecord],
    log_dir: Path,
    tokenizer: TinyTokenizerFiles | None,
) -> dict[str, ArmResult]:
    urls = loopback_urls(setup.replicas + 1)
    remote, replicas = urls[0], urls[1:]
    precise = None
    if tokenizer is not None:
        precise = Precise(tokenizer, tuple(free_port() for _ in replicas))
    name = f"speed{speed:g}"
    out: dict[str, ArmResult] = {}
    with sim_from_config(sim_config(setup, replicas, remote, speed, precise), log_dir, name):
        for arm in arms:
            reset(replicas, remote)
            before = scrape(replicas, SIM_COUNTERS)
            config = gateway_config(setup, replicas, remote, arm, speed, precise)
            with gateway_from_config(config, log_dir, f"{name}-{arm}") as gw:
                samples, elapsed_s, gateway = asyncio.run(send_trace(trace, gw.url))
            after = scrape(replicas, SIM_COUNTERS)
            sims = {k: v - before.get(k, 0.0) for k, v in after.items()}
            result = ArmResult(
                arm,
                speed,
                samples,
                elapsed_s,
                sims,
                PREFILL_TOKENS_PER_S / speed,
                setup.replicas,
                gateway,
            )
            out[arm] = result
            st = result.stats
            console.print(
                f"  speed {speed:g} {arm:<10} {st['ok']}/{st['requests']} ok, err p90 after "
                f"{_pct(st['err_p90_after'])}, prefill util {st['prefill_utilisation']:.2f}; "
                f"goal {_pct(st['err_p90_after_goal'])}, with the observed time outside the "
                f"sims' engines {_pct(st['err_p90_after_goal_engine_terms'])} (that time p50 / "
                f"p90: {' / '.join(f'{v:.0f}' for v in st['outside_engine_ms_p50_p90'])} ms); "
                f"with the sims' load / wait / both {_pct(st['err_p90_after_goal_sim_load'])} / "
                f"{_pct(st['err_p90_after_goal_sim_wait'])} / "
                f"{_pct(st['err_p90_after_goal_sim_load_wait'])}; knowing all but the future "
                f"{_pct(st['err_p90_after_goal_no_future'])} (x{st['no_future_best_scale']:.2f} "
                f"in hindsight {_pct(st['err_p90_after_goal_no_future_best_scale'])}; "
                f"replay off by {_pct(st['replay_err_p90_after_goal'])}); the index's tiers "
                f"as the sims' for {'/'.join(map(str, st['tiers_as_sims']))} requests"
            )
    return out


# --- report ----------------------------------------------------------------------------------


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


def _num(value: float, fmt: str) -> str:
    return "-" if math.isnan(value) else format(value, fmt)


def table(results: Mapping[float, Mapping[str, ArmResult]]) -> Table:
    t = Table(
        title="TTFT estimate vs client-observed time to first chunk: |est - obs| / obs",
        box=box.SIMPLE_HEAD,
        caption=f"first / after: the first {FIRST_N} requests of an arm / the rest; "
        f"goal: err p90 after over TTFT >= {GOAL_MIN_TTFT_S * 1000:.0f} ms (<= {GOAL_P90:.0%}); "
        "est/obs: median ratio (bias); after load est/obs: mean estimate without its load term "
        "vs the observed TTFT without the sims' load time (ms), its err: p90 of their "
        "difference / obs after; floor: the p90 after that no "
        "model with a fixed term reaches, from the requests that cost only that term (their share "
        "of the requests after); gw <=20%: share of the requests after whose estimate was within "
        "20% of the TTFT the gateway observed (sent to first byte; the goal is 90%); util: "
        "prefill utilisation; tiers: share of prompt tokens from "
        "HBM / CPU / remote",
    )
    columns = (
        "speed", "mode", "err p50 first", "err p90 first", "err p50 after", "err p90 after",
        "goal (n)", "floor (share)", "gw <=20%", "est/obs", "after load est/obs", "its err",
        "hit rate",
        "TTFT p50", "TTFT p99", "util", "tiers h/c/r", "errors",
    )  # fmt: skip
    for c in columns:
        t.add_column(c, justify="left" if c == "mode" else "right")
    for speed, arms in results.items():
        for arm, r in arms.items():
            s = r.stats
            tiers = s["tier_share"]
            t.add_row(
                f"{speed:g}x",
                arm,
                _pct(s["err_p50_first"]),
                _pct(s["err_p90_first"]),
                _pct(s["err_p50_after"]),
                _pct(s["err_p90_after"]),
                f"{_pct(s['err_p90_after_goal'])} ({s['n_after_goal']})",
                f"{_pct(s['err_p90_floor'])} ({s['fixed_only_share']:.0%})",
                _pct(s["gateway_within_20_after"]),
                _num(s["est_over_obs_p50"], ".2f"),
                f"{_num(s['after_load_est_ms_mean'], '.0f')}/"
                f"{_num(s['after_load_obs_ms_mean'], '.0f')}",
                _pct(s["after_load_err_p90_after"]),
                f"{s['hit_rate']:.1%}",
                _num(s["ttft_p50_ms"], ",.0f"),
                _num(s["ttft_p99_ms"], ",.0f"),
                f"{s['prefill_utilisation']:.2f}",
                "/".join(_num(tiers[k] * 100, ".0f") for k in ("hbm", "cpu", "remote")),
                str(s["errors"]),
            )
    return t


def rolling_p90(values: Sequence[float | None], window: int) -> tuple[list[int], list[float]]:
    xs: list[int] = []
    ys: list[float] = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1) : i + 1] if v is not None]
        if chunk and i + 1 >= min(window, len(values)):
            xs.append(i)
            ys.append(percentile(chunk, 90))
    return xs, ys


def plot(path: Path, results: Mapping[float, Mapping[str, ArmResult]]) -> None:
    plt = figures.pyplot()
    panels = max(1, len(results))
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False, sharey=True)
    for ax, (speed, arms) in zip(axes[0], results.items(), strict=False):
        for arm, r in arms.items():
            xs, ys = rolling_p90([s.rel_error for s in r.samples], ROLLING_WINDOW)
            ax.plot(xs, ys, label=arm, linestyle="--" if arm == TRUE_ARM else "-")
        ax.axvline(FIRST_N, color="grey", linewidth=0.8, linestyle=":")
        ax.set_yscale("log")
        ax.set_xlabel("request index")
        ax.set_title(f"fleet {speed:g}x slower than the defaults")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel(f"|est - obs| / obs, rolling p90 ({ROLLING_WINDOW} requests)")
    title = "cachelane TTFT estimate error by calibration mode (simulated fleet)"
    figures.save_figure(fig, path, title=title)


# --- CLI -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = harness.parser(
        "estimate",
        "TTFT estimate error per calibration mode on fleets slower than the defaults.",
        quick=f"{QUICK_DURATION_S:.0f} s per arm",
    )
    add = p.add_argument
    add("--duration-s", type=float, default=None, help="per arm (default: 30, --quick 4)")
    add("--speeds", default=",".join(f"{s:g}" for s in SPEEDS), help="(default: %(default)s)")
    harness.add_names(p, "--modes", MODES, "routing.calibration")
    add(
        "--index",
        choices=("precise", "approximate"),
        default="approximate",
        help="precise: the sims publish KV events and the gateway reads them (the tiers are "
        "known); approximate: the gateway guesses where blocks are (default: %(default)s)",
    )
    add("--no-true", action="store_true", help=f"skip the `{TRUE_ARM}` reference arm")
    add("--rate", type=float, default=None, help="req/s (default: from the slowest speed)")
    harness.add_seed_and_out(p, Path("results/bench_estimate.json"))
    return p


def _parse_speeds(text: str) -> list[float]:
    speeds = [float(s) for s in text.split(",") if s.strip()]
    if not speeds or any(s <= 0 for s in speeds):
        raise ValueError(f"--speeds: need positive numbers, got {text!r}")
    return speeds


def payload(
    setup: Setup,
    results: Mapping[float, Mapping[str, ArmResult]],
    info: Mapping[str, Any],
    wall_s: float,
) -> dict[str, Any]:
    return {
        **info,
        "setup": asdict(setup),
        "first_n": FIRST_N,
        "results": [
            {
                "speed": speed,
                "sim_costs": sim_costs(speed),
                "offered_utilisation": info["offered_utilisation"].get(f"{speed:g}"),
                "arms": {arm: r.to_dict() for arm, r in arms.items()},
            }
            for speed, arms in results.items()
        ],
        "wall_time_s": wall_s,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = harness.console(width=160)
    try:
        speeds = _parse_speeds(args.speeds)
    except ValueError as err:
        console.print(f"[red]bench_estimate: {err}")
        return 2
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        console.print(f"[red]bench_estimate: unknown modes {bad}; known: {', '.join(MODES)}")
        return 2
    arms = ([] if args.no_true else [TRUE_ARM]) + modes
    duration_s = args.duration_s or (QUICK_DURATION_S if args.quick else DURATION_S)
    out: Path = args.out
    log_dir = harness.log_dir(out)
    slowest = max(speeds)
    tokenizer = None
    setup = Setup()
    if args.index == "precise":
        tokenizer = write_tiny_tokenizer(log_dir / "tokenizer")
        probe = _trace(PROBE_RATE_PER_S, PROBE_DURATION_S, args.seed, slowest)
        setup = Setup(token_inflation=round(token_inflation(probe, tokenizer), 3))
    f = setup.token_inflation
    rate = args.rate or pick_rate(setup, slowest, args.seed)
    trace = _trace(rate, duration_s, args.seed, slowest, f)
    ideal = traces.ideal_hits(trace)
    per_request = uncached_per_request(_trace(rate, PROBE_DURATION_S, args.seed, slowest, f), f)
    offered = {f"{s:g}": rate * per_request / fleet_prefill_tokens_per_s(setup, s) for s in speeds}
    console.print(
        f"{len(trace)} requests over {duration_s:.0f} s ({rate:g} req/s, chat + RAG), ideal hit "
        f"rate {ideal.hit_rate:.1%}; expected prefill utilisation "
        + ", ".join(f"{u:.2f} at {s}x" for s, u in offered.items())
        + f"; arms {', '.join(arms)}; {args.index} index"
    )
    info = {
        "duration_s": duration_s,
        "rate_per_s": rate,
        "workload": {"weights": WEIGHTS, "max_tokens": MAX_TOKENS, "seed": args.seed},
        "requests": len(trace),
        "ideal_hit_rate": ideal.hit_rate,
        "offered_utilisation": offered,
        "arms": arms,
        "index": args.index,
    }
    started = time.perf_counter()
    results: dict[float, dict[str, ArmResult]] = {}

    def run_arms() -> None:
        for speed in speeds:
            results[speed] = run_speed(console, setup, speed, arms, trace, log_dir, tokenizer)

    code = harness.run_arms(console, "bench_estimate", run_arms, (RuntimeError, httpx.HTTPError))
    if code:
        return code
    wall_s = time.perf_counter() - started
    console.print(table(results))
    summary = payload(setup, results, info, wall_s)
    harness.write_results(console, out, summary, lambda png: plot(png, results), wall_s, log_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
