"""The members of loadtest/bench/family.py: each a (trace, fleet, load) triple drawn from ranges.

A member's fleet is drawn, seeded, from what production fleets span (scaled to two shared cores):
2-8 replicas; HBM a fraction of the trace's working set (so placement decides hits); a CPU
offload tier on about half, a shared remote tier on about a third; vLLM V1 engines with
`--max-num-batched-tokens` 512-8192, a long-prefill threshold or none, `fcfs` or `priority`, a
decode step of 10-40 ms; and a load of 0.3-0.9 of the fleet's prefill. The load fixes the prefill
rate: the trace's uncached work (its oracle: one unlimited cache) at its request rate, over the
replicas' prefill at that load. The request rate is drawn where two cores can drive it.

Traces: the project's own shapes (loadtest/workloads/traces.py) and, where the files are given,
slices of Mooncake's production traces (loadtest/workloads/mooncake.py) at a seeded offset.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtest.sim.fleet import step_flags
from loadtest.sim.steps import StepSettings
from loadtest.workloads import mooncake, traces
from loadtest.workloads.critical_traces import Floor, ideal_floor
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS, block_hashes
from routing.prompt import approx_tokens

MODEL = traces.DEFAULT_MODEL

PROJECT_TRACES = ("mixed", "chat", "rag", "agentic", "shared_system")
MOONCAKE_TRACES = ("conversation", "synthetic", "toolagent")
# the FAST'25 release's files: FAST25-release/traces/<name>_trace.jsonl
ROTATION = (
    "mixed",
    "mooncake:conversation",
    "mooncake:synthetic",
    "chat",
    "rag",
    "mooncake:conversation",
    "agentic",
    "mooncake:synthetic",
    "shared_system",
    "mixed",
    "mooncake:conversation",
    "rag",
)
# Member i takes ROTATION[i % len]: a third or more from the public traces, every project shape.

REPLICAS = (2, 8)
RATE_PER_S = (5.0, 10.0)
# Requests per second two shared cores drive through a router and the whole simulated fleet with
# every request streamed (docs/bench/routing.md ran 8-15/s with shorter outputs).
LOAD = (0.3, 0.9)  # of the fleet's prefill, at the oracle's hit rate
PREFILL_TOKENS_PER_S = (2_000.0, 40_000.0)
# The bounds a drawn rate is clamped to: a CPU build of a small model to an H200's 8B
# (routing/cost.py, 30k tokens/s).
HBM_SHARE = (0.15, 0.8)
# The fleet's HBM as a share of the trace's distinct prompt tokens: from heavy eviction to most of
# the working set fitting; each replica holds at least HBM_MIN_PROMPTS x the largest prompt.
HBM_MIN_PROMPTS = 1.5
CPU_SHARE, CPU_TIMES_HBM = 0.5, (2.0, 4.0)  # host RAM is several times HBM
REMOTE_SHARE = 0.35
BUDGET_TOKENS = (512, 8_192)  # --max-num-batched-tokens, log-uniform, in steps of 256
THRESHOLD_SHARE = 0.3  # members with a --long-prefill-token-threshold (a quarter of the budget)
DECODE_STEP_S = (0.010, 0.040)  # a step of decodes alone (the replica's ITL)


@dataclass(frozen=True, slots=True)
class FleetDraw:
    replicas: int
    prefill_tokens_per_s: float
    hbm_tokens: int
    cpu_tokens: int
    remote: bool
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    scheduling_policy: str
    decode_step_s: float

    def steps(self) -> StepSettings:
        return StepSettings(
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            scheduling_policy="priority" if self.scheduling_policy == "priority" else "fcfs",
            decode_step_s=self.decode_step_s,
        )

    def sim_args(self) -> list[str]:
        return step_flags(self.steps())

    @property
    def tiers(self) -> str:
        return "+".join(["hbm"] + ["cpu"] * bool(self.cpu_tokens) + ["remote"] * self.remote)


@dataclass(frozen=True)
class Member:
    index: int
    trace_name: str
    trace: list[traces.TraceRecord]
    fleet: FleetDraw
    load: float
    rate_per_s: float
    ideal_hit: float
    floor: Floor

    @property
    def name(self) -> str:
        return f"m{self.index:02d}-{self.trace_name.replace('mooncake:', 'mc-')}"

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "trace": self.trace_name,
            "requests": len(self.trace),
            "rate_per_s": round(self.rate_per_s, 2),
            "load": round(self.load, 3),
            "ideal_hit": round(self.ideal_hit, 4),
            "fleet": asdict(self.fleet),
        }


def log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _uncached_tokens(trace: Sequence[traces.TraceRecord]) -> tuple[int, int, int]:
    """(uncached tokens with one unlimited cache, distinct prompt tokens, the largest prompt)."""
    bs = DEFAULT_BLOCK_SIZE_TOKENS
    seen: set[int] = set()
    uncached = largest = 0
    for record in sorted(trace, key=lambda r: r["t_s"]):
        text = traces.prompt_text(record)
        n = approx_tokens(text)
        largest = max(largest, n)
        hashes = block_hashes(text, block_size_tokens=bs, namespace=MODEL)
        hit = 0
        for h in hashes[: (n - 1) // bs]:
            if h not in seen:
                break
            hit += 1
        uncached += n - hit * bs
        seen.update(hashes)
    return uncached, len(seen) * bs, largest


def build_trace(
    name: str, requests: int, rate_per_s: float, seed: int, mooncake_dir: Path | None
) -> list[traces.TraceRecord]:
    """`requests` records of the named trace at about `rate_per_s`."""
    if name.startswith("mooncake:"):
        rest = name.removeprefix("mooncake:")
        if rest in MOONCAKE_TRACES:  # a name in --mooncake-dir, at a seeded offset
            if mooncake_dir is None:
                raise ValueError(f"{name} needs --mooncake-dir")
            path = mooncake_dir / f"{rest}_trace.jsonl"
            with path.open() as f:
                total = sum(1 for _ in f)
            start = random.Random(f"{seed}-{name}-start").randrange(0, max(1, total - requests))
            spec = mooncake.Spec(path, start, requests)
        else:  # a file, as --trace takes it: PATH[@START:COUNT]
            spec = mooncake.Spec.parse(rest)
            spec = mooncake.Spec(spec.path, spec.start, min(spec.count or requests, requests))
        records = mooncake.read_records(spec)
        span = max(mooncake.span_s(records), 1e-3)
        return mooncake.to_trace(records, time_scale=len(records) / rate_per_s / span)
    duration_s = requests / rate_per_s
    # A session's next turn waits for its previous one, at about half a modest replica's speed.
    bound = traces.ServiceBound(prefill_tokens_per_s=2_000.0, itl_s=0.06)
    if name == "mixed":
        trace = traces.mixed(rate_per_s=rate_per_s, duration_s=duration_s, seed=seed, bound=bound)
    else:
        trace = traces.shape_trace(
            name, rate_per_s=rate_per_s, duration_s=duration_s, seed=seed, bound=bound
        )
    return trace[:requests]


def draw_fleet(
    rng: random.Random, trace: Sequence[traces.TraceRecord], rate_per_s: float, load: float
) -> FleetDraw:
    uncached, distinct, largest = _uncached_tokens(trace)
    span_s = max(trace[-1]["t_s"] - trace[0]["t_s"], 1e-3) if trace else 1.0
    work_tokens_per_s = uncached / span_s
    # fewer replicas where the drawn count would need a prefill below the range to reach the load
    most = max(REPLICAS[0], math.floor(work_tokens_per_s / (load * PREFILL_TOKENS_PER_S[0])))
    replicas = min(rng.randint(*REPLICAS), most)
    prefill = work_tokens_per_s / (load * replicas)
    prefill = min(max(prefill, PREFILL_TOKENS_PER_S[0]), PREFILL_TOKENS_PER_S[1])
    hbm = max(distinct * rng.uniform(*HBM_SHARE) / replicas, HBM_MIN_PROMPTS * largest)
    cpu = round(hbm * rng.uniform(*CPU_TIMES_HBM)) if rng.random() < CPU_SHARE else 0
    budget = round(log_uniform(rng, *BUDGET_TOKENS) / 256) * 256
    return FleetDraw(
        replicas=replicas,
        prefill_tokens_per_s=round(prefill),
        hbm_tokens=int(hbm),
        cpu_tokens=cpu,
        remote=rng.random() < REMOTE_SHARE,
        max_num_batched_tokens=max(BUDGET_TOKENS[0], budget),
        long_prefill_token_threshold=budget // 4 if rng.random() < THRESHOLD_SHARE else 0,
        scheduling_policy=rng.choice(("fcfs", "priority")),
        decode_step_s=round(rng.uniform(*DECODE_STEP_S), 4),
    )


def realised_load(trace: Sequence[traces.TraceRecord], fleet: FleetDraw) -> float:
    uncached, _, _ = _uncached_tokens(trace)
    span_s = max(trace[-1]["t_s"] - trace[0]["t_s"], 1e-3)
    return uncached / span_s / (fleet.replicas * fleet.prefill_tokens_per_s)


def draw_member(
    index: int, seed: int, requests: int, mooncake_dir: Path | None, trace_name: str | None = None
) -> Member:
    rng = random.Random(f"family-{seed}-{index}")
    name = trace_name or ROTATION[index % len(ROTATION)]
    if name.removeprefix("mooncake:") in MOONCAKE_TRACES and mooncake_dir is None:
        name = PROJECT_TRACES[index % len(PROJECT_TRACES)]
    rate = rng.uniform(*RATE_PER_S)
    load = rng.uniform(*LOAD)
    trace = build_trace(name, requests, rate, seed * 1000 + index, mooncake_dir)
    fleet = draw_fleet(rng, trace, rate, load)
    return Member(
        index=index,
        trace_name=name,
        trace=trace,
        fleet=fleet,
        load=realised_load(trace, fleet),
        rate_per_s=len(trace) / max(trace[-1]["t_s"], 1e-3),
        ideal_hit=traces.ideal_hit_rate(trace, model=MODEL),
        floor=ideal_floor(trace, fleet.prefill_tokens_per_s, model=MODEL, steps=fleet.steps()),
    )
