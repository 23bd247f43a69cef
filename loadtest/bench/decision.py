"""The routing decision in-process, this checkout against another commit, alternated in one run.

    python -m loadtest.bench.decision --baseline 39ba0f4            # ~1 min: 8k tokens, 16 replicas
    python -m loadtest.bench.decision --baseline REF --tokens 32768 --replicas 64 --rounds 3

What the gateway does per request in approximate mode, without HTTP: canonical prompt text,
block hashes (the planner's hasher: `PrefixHasher` where the code has it, `block_hashes` before),
memory-index lookup, decide(cache_aware). The prompt is what most requests are: a prefix sent
before (every replica holds a different share of it, half of them are busy) and a new
QUESTION_TOKENS-token question each time. Each round runs each code in a fresh process (the
baseline's routing/ extracted with `git archive`; the prompts are this checkout's), in
alternating order, so both see the same
machine; compare the ratio, not the absolute figures (this machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

OUT_PATH = Path("results/bench_decision.json")
QUESTION_TOKENS = 64
WARMUP = 200
ITERATIONS = 1_000
MODEL = "m"


def measure(tokens: int, replicas: int, iterations: int) -> list[float]:
    """Each decision's time (us) with whatever routing/ is first on sys.path (so nothing here
    may need what a baseline's routing/ lacks)."""
    from loadtest.workloads import traces
    from routing import hashing
    from routing.cost import Load, PoolCosts
    from routing.decide import Candidate, Policy, RouteRequest, decide
    from routing.index import MemoryIndex
    from routing.prompt import approx_tokens, chat_text
    from routing.types import Location, Tier

    rng = random.Random(7)
    prefix = traces.words_text(rng, tokens - QUESTION_TOKENS)
    questions = [traces.words_text(rng, QUESTION_TOKENS) for _ in range(50)]
    hasher = getattr(hashing, "PrefixHasher", None)
    hash_ = hasher().block_hashes if hasher is not None else hashing.block_hashes
    index = MemoryIndex()
    namespace = f"{MODEL}|bench"
    sent = hash_(chat_text([{"role": "user", "content": prefix}]), namespace=namespace)
    for i in range(replicas):
        held = sent[: max(1, len(sent) * (i + 1) // replicas)]
        index.record_now(MODEL, held, Location(f"r{i}", Tier.HBM))
    costs = PoolCosts()
    candidates = [
        Candidate(
            f"r{i}", load=Load(in_flight=i % 8, pending_prefill_tokens=(i % 4) * 2048), costs=costs
        )
        for i in range(replicas)
    ]
    decide_rng = random.Random(1)
    totals: list[float] = []
    for i in range(WARMUP + iterations):
        messages = [{"role": "user", "content": prefix + questions[i % len(questions)]}]
        t0 = time.perf_counter()
        prompt = chat_text(messages)
        hashes = hash_(prompt, namespace=namespace)
        hits = index.lookup_now(MODEL, hashes)
        request = RouteRequest(hashes, approx_tokens(prompt), 16)
        decide(request, candidates, hits, Policy.CACHE_AWARE, seq=i, rng=decide_rng)
        if i >= WARMUP:
            totals.append((time.perf_counter() - t0) * 1e6)
    return totals


def _run(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    """One measurement in a fresh process whose routing/ is `tree`'s (the rest is this
    checkout's: `tree` holds routing/ alone)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(Path.cwd())])}
    cmd = [sys.executable, "-m", "loadtest.bench.decision", "--child"]
    cmd += ["--tokens", str(args.tokens), "--replicas", str(args.replicas)]
    cmd += ["--iterations", str(args.iterations)]
    out = subprocess.run(cmd, env=env, cwd=tree, check=True, capture_output=True, text=True)
    from routing.whatif.summary import percentile  # here: the child's routing/ may be older

    totals: list[float] = json.loads(out.stdout)
    return {"p50_us": percentile(totals, 50), "p99_us": percentile(totals, 99)}


def _extract(ref: str, into: Path) -> Path:
    """routing/ as it was at `ref`."""
    archive = subprocess.run(
        ["git", "archive", ref, "routing"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.decision", description=__doc__)
    parser.add_argument("--baseline", metavar="GIT_REF", help="the commit to compare against")
    parser.add_argument("--tokens", type=int, default=8_192)
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    parser.add_argument("--out", type=Path, default=OUT_PATH)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.tokens, args.replicas, args.iterations)))
        return 0
    here = Path.cwd()
    runs: dict[str, list[dict[str, float]]] = {"this checkout": []}
    with tempfile.TemporaryDirectory(prefix="cachelane-decision-") as tmp:
        trees = {"this checkout": here}
        if args.baseline:
            label = f"@{args.baseline}"
            trees[label] = _extract(args.baseline, Path(tmp))
            runs[label] = []
        for round_ in range(args.rounds):
            order = list(trees.items())
            for label, tree in order if round_ % 2 == 0 else order[::-1]:
                runs[label].append(_run(tree, args))
    table = Table(
        title=f"decision in-process, {args.tokens} tokens, {args.replicas} replicas, memory "
        f"index: {args.rounds} alternated rounds of {args.iterations} (us)"
    )
    for column in ("code", "p50 per round", "p99 per round", "p50 median", "p99 median"):
        table.add_column(column, justify="left" if column == "code" else "right")
    for label, rows in runs.items():
        p50s, p99s = [r["p50_us"] for r in rows], [r["p99_us"] for r in rows]
        table.add_row(
            label,
            " ".join(f"{v:.0f}" for v in p50s),
            " ".join(f"{v:.0f}" for v in p99s),
            f"{statistics.median(p50s):.0f}",
            f"{statistics.median(p99s):.0f}",
        )
    Console(width=140).print(table)
    payload: dict[str, Any] = {"settings": vars(args) | {"out": str(args.out)}, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
