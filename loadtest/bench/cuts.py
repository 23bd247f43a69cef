"""Before/after of the small hot-path cuts, in one process, arms alternating.

    python -m loadtest.bench.cuts --baseline REF      # ~2 min

Each arm is one module as it is here and as it was at git REF (loaded from `git show`):
MemoryIndex.record_now of a new 256-token prompt (16 blocks, as `record_sent` does for a
request whose prompt is new) into an index that already holds 50,000 blocks; and key_values
of a streamed request's access line; the cost learner (gateway/accounting/calibration.py) taking
one observed TTFT in "fit" mode, warm (every replica past its own fit's first samples): at REF
as the settlement called it, here as it calls it now (queued, learned in batches of BATCH, the
observations of 100 ms at 100 req/s; and of 1, one request per 100 ms); the cost accounting's
counters of one streamed answer (gateway/accounting/ledger.py `_export`, a 256-token prompt
mostly found in HBM); the cost fit (routing/learn.py `OnlineFit`, warm) taking one observation
and solved every BATCH (the learner's batches). Rounds alternate the two versions so both see
the same machine; the ratio (here / REF) of the medians is the figure to read.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from routing.types import Location, Tier

ROUNDS = 20
CALLS = 500  # per round and arm
BLOCKS = 16  # a 256-token prompt at 16 tokens a block
FILLED = 50_000  # blocks already held: a warm index
ACCESS = {
    "request_id": "9f1c0e6a2b7d4c3e8f5a1b2c3d4e5f60", "method": "POST",
    "path": "/v1/chat/completions", "status": 200, "code": None, "tenant": "default",
    "class": "standard", "model": "sim-llama-8b", "replica": "r0", "reason": "cache_hit",
    "ttft_ms": 3.412, "e2e_ms": 5.031, "prompt_tokens": 262, "cached_tokens": 240,
    "expected_cached_tokens": 240,
}  # fmt: skip


def module_at(ref: str, path: str, name: str, tmp: Path) -> ModuleType:
    source = subprocess.run(["git", "show", f"{ref}:{path}"], check=True, capture_output=True)
    file = tmp / f"{name}.py"
    file.write_bytes(source.stdout)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def index_arm(module: ModuleType) -> Callable[[], None]:
    index = module.MemoryIndex()
    where = Location("r0", Tier.HBM)
    index.record_now("m", list(range(1, FILLED + 1)), where)
    counter = iter(range(FILLED + 1, 1 << 62, BLOCKS))

    def record() -> None:
        start = next(counter)
        index.record_now("m", list(range(start + BLOCKS - 1, start - 1, -1)), where)

    return record


BATCH = 10


def learner_arm(module: ModuleType, batch: int | None) -> Callable[[], None]:
    """`batch` None: `observe` each observation (the learner at REF); else `queue` it and learn
    the queue every `batch` observations."""
    from gateway.config import parse_config
    from gateway.fleet.registry import Registry
    from gateway.telemetry.metrics import Metrics
    from routing.cost import Load, Overlap, estimate
    from routing.decide import Score

    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    registry = Registry(parse_config({"pools": [{"name": "p", "replicas": urls}]}))
    replicas = list(registry.replicas.values())
    learner = module.CostLearner("fit", replicas, Metrics())
    observations = []
    for i in range(64):
        r = replicas[i % 2]
        overlap = Overlap(256 + 64 * (i % 8), hbm_tokens=64 * (i % 4))
        score = Score(r.name, overlap, estimate(overlap, Load(), r.costs, r.terms))
        observed_s = 0.004 + overlap.prompt_tokens * 2e-5 * (1 + 0.02 * (i % 5))
        observations.append(module.Observation(r, score, observed_s, None))
    for ob in observations:  # warm: every replica on its own fit
        learner.observe(ob)
    cycle = itertools.cycle(observations)
    if batch is None:
        return lambda: learner.observe(next(cycle))
    count = itertools.count(1)

    def queue() -> None:
        learner.queue(next(cycle))
        if next(count) % batch == 0:
            learner.learn_queued()

    return queue


def fit_arm(module: ModuleType) -> Callable[[], None]:
    """routing/learn.py's OnlineFit, warm (a full window), taking one observation of a mixed
    trace (queued work, swaps, fetches, steps; 10% lognormal noise) and solved every BATCH, as
    the learner's batches do."""
    import random

    from routing.cost import CostTerms, PoolCosts

    seed = CostTerms.seed(PoolCosts())
    rng = random.Random(1)
    samples = []
    for _ in range(2_000):
        queued = rng.choice([0.0, 0.0, 0.0, rng.uniform(0, 8000)])
        uncached = rng.uniform(50, 4000)
        swapped = rng.choice([0.0, 0.0, rng.uniform(500, 6000)])
        fetched = rng.choice([0.0, 0.0, rng.uniform(1000, 8000)])
        ttft = 0.02 + 3 * (
            seed.prefill_s_per_token * (queued + uncached)
            + seed.swap_s_per_token * swapped
            + seed.fetch_s_per_token * fetched
        )
        noisy = ttft * rng.lognormvariate(0, 0.1)
        samples.append(module.Sample(queued, uncached, swapped, fetched, noisy, rng.randint(1, 20)))
    fit = module.OnlineFit(seed)
    for sample in samples[:300]:
        fit.update(sample)
    cycle = itertools.cycle(samples)
    count = itertools.count(1)

    def observe() -> None:
        fit.update(next(cycle), refit=False)
        if next(count) % BATCH == 0:
            fit.refit()

    return observe


ANSWER = {
    "requests": 1, "timed_requests": 1, "fixed_s": 0.002, "queue_s": 0.0, "swap_s": 0.0,
    "fetch_s": 0.0, "prefill_s": 0.0004, "hbm_tokens": 240, "cpu_tokens": 0, "remote_tokens": 0,
    "computed_tokens": 16, "avoided_hbm_s": 0.006, "avoided_cpu_s": 0.0,
    "avoided_remote_s": 0.0, "hbm_inserted_blocks": 1,
}  # fmt: skip


def ledger_arm(module: ModuleType) -> Callable[[], None]:
    from gateway.config import parse_config
    from gateway.fleet.registry import Registry
    from gateway.telemetry.metrics import Metrics
    from routing.accounting import CostKey

    config = parse_config({"pools": [{"name": "p", "replicas": ["http://127.0.0.1:1"]}]})
    accounting = module.CostAccounting(config, Registry(config), Metrics())
    key = CostKey("default", "standard", "p")
    return lambda: accounting._export(key, ANSWER)


def key_values_arm(module: ModuleType) -> Callable[[], None]:
    return lambda: module.key_values(ACCESS)


def timed(call: Callable[[], None]) -> float:
    started = time.perf_counter()
    for _ in range(CALLS):
        call()
    return (time.perf_counter() - started) / CALLS * 1e6


def compare(arms: dict[str, Callable[[], None]]) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(ROUNDS):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for name in order:
            samples[name].append(timed(arms[name]))
    return {name: statistics.median(values) for name, values in samples.items()}


async def in_a_loop(arms: dict[str, Callable[[], None]]) -> dict[str, float]:
    return compare(arms)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.cuts", description=__doc__)
    parser.add_argument("--baseline", required=True, metavar="GIT_REF")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        results: dict[str, Any] = {}
        for label, path, arm in (
            ("MemoryIndex.record_now, 16 new blocks", "routing/index.py", index_arm),
            ("key_values, an access line", "gateway/telemetry/logs.py", key_values_arm),
            ("CostAccounting._export, one answer", "gateway/accounting/ledger.py", ledger_arm),
            (f"OnlineFit, one observation, solved every {BATCH}", "routing/learn.py", fit_arm),
        ):
            here = module_at("HEAD", path, "here_" + Path(path).stem, tmp)
            then = module_at(args.baseline, path, "then_" + Path(path).stem, tmp)
            results[label] = compare({"here": arm(here), args.baseline: arm(then)})
        here = module_at("HEAD", "gateway/accounting/calibration.py", "here_calibration", tmp)
        then = module_at(args.baseline, "gateway/accounting/calibration.py", "then_cal", tmp)
        arms = {
            f"here, batches of {BATCH}": learner_arm(here, BATCH),
            "here, batches of 1": learner_arm(here, 1),
            args.baseline: learner_arm(then, None),
        }
        label = "CostLearner, one observed TTFT"
        results[label] = asyncio.run(in_a_loop(arms))  # `queue` defers to a running loop
    for label, medians in results.items():
        if label.startswith("CostLearner"):
            then = medians[args.baseline]
            for arm, us in medians.items():
                print(f"{label}: {arm}: {us:.2f} us ({us / then:.2f}x {args.baseline})")
            continue
        here, then = medians["here"], medians[args.baseline]
        print(f"{label}: {here:.2f} us here, {then:.2f} us at {args.baseline}: {here / then:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
