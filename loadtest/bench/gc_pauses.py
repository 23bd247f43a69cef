"""Full garbage collections inside the gateway under load: how often, how long, before and after.

    python -m loadtest.bench.gc_pauses --baseline REF        # ~2 min: this checkout and REF
    python -m loadtest.bench.gc_pauses --quick                # ~30 s, this checkout only

CPython's cyclic GC stops the event loop for a full collection, and every request in flight
waits for it. How long one takes grows with the objects the GC tracks: the gateway's imports,
and whatever its index keeps per block. Four zero-delay simulated replicas answer at once; 16
clients send, closed loop for DURATION_S, non-streaming chat requests of one of 40 shared
6k-token documents plus 1.5k tokens of their own, so the gateway's index grows to its replicas'
HBM capacity (the defaults: 50k blocks each) as a busy fleet's does. Each gateway (this checkout,
then the baseline's gateway/ and routing/ from `git archive`) runs in turn with a
sitecustomize hook (written here, put on its PYTHONPATH) that times every generation-2
collection through `gc.callbacks`.

Prints a table (requests, req/s, full collections, pause p50 / max, the share of the run spent
in them) and writes results/bench_gc_pauses.json. The machine is shared: compare the rows of
one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from loadtest.bench import harness, report
from loadtest.bench.overhead import baseline_tree, closed_loop
from loadtest.bench.peer_routers import RouterSpec, running_router
from loadtest.bench.processes import SimFleetSettings, sim_fleet
from loadtest.sim.config import SIM_MODEL
from loadtest.workloads import traces
from routing.cost import HBM_CAPACITY_TOKENS
from routing.whatif.summary import percentile

OUT_PATH = Path("results/bench_gc_pauses.json")
DURATION_S = 40.0
QUICK_DURATION_S = 10.0
CLIENTS = 16
DOCUMENTS = 40
DOCUMENT_TOKENS = 6_000
OWN_TOKENS = 1_500
REPLICAS = 4
LOG_ENV = "CACHELANE_BENCH_GC_LOG"

HOOK = f'''
import gc, os, time
_path = os.environ.get("{LOG_ENV}")
if _path:
    _started = [0.0]

    def _timed(phase, info):
        if info["generation"] != 2:
            return
        if phase == "start":
            _started[0] = time.perf_counter()
            return
        with open(_path, "a") as f:
            f.write(f"{{time.perf_counter() - _started[0]:.6f}}\\n")

    gc.callbacks.append(_timed)
'''


@contextlib.contextmanager
def gc_hook(log_path: Path) -> Iterator[None]:
    """The timing hook on PYTHONPATH and its log path in the environment of what starts now."""
    with tempfile.TemporaryDirectory(prefix="cachelane-gc-hook-") as directory:
        Path(directory, "sitecustomize.py").write_text(HOOK)
        saved = {k: os.environ.get(k) for k in ("PYTHONPATH", LOG_ENV)}
        paths = [directory, *filter(None, [saved["PYTHONPATH"]])]
        os.environ["PYTHONPATH"] = os.pathsep.join(paths)
        os.environ[LOG_ENV] = str(log_path)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def prompt_bodies() -> Callable[[int, int], dict[str, Any]]:
    """Each request: one of the shared documents and OWN_TOKENS of its own."""
    rng = random.Random(3)
    documents = [traces.words_text(rng, DOCUMENT_TOKENS) for _ in range(DOCUMENTS)]

    def body(w: int, i: int) -> dict[str, Any]:
        own = traces.words_text(random.Random(w * 1_000_003 + i), OWN_TOKENS)
        text = f"{w}-{i} {own} {documents[(w + i) % DOCUMENTS]}"
        return {
            "model": SIM_MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 2,
            "stream": False,
        }

    return body


def run_one(
    spec: RouterSpec, urls: Sequence[str], log_dir: Path, duration_s: float
) -> dict[str, Any]:
    log_path = log_dir / f"gc-{spec.label.replace(':', '-')}.log"
    log_path.unlink(missing_ok=True)
    with gc_hook(log_path), running_router(spec, urls, log_dir) as router:
        loop = closed_loop(router.url, duration_s, body=prompt_bodies(), concurrency=CLIENTS)
        ok, errors, elapsed_s = asyncio.run(loop)
    time.sleep(0.2)  # the gateway has stopped; its last line is written
    pauses_ms = (
        [1000 * float(line) for line in log_path.read_text().split() if line]
        if log_path.exists()
        else []
    )
    return {
        "label": spec.label,
        "requests": ok,
        "errors": errors,
        "requests_per_s": ok / elapsed_s if elapsed_s else 0.0,
        "full_collections": len(pauses_ms),
        "pause_p50_ms": percentile(pauses_ms, 50) if pauses_ms else 0.0,
        "pause_max_ms": max(pauses_ms, default=0.0),
        "paused_share": sum(pauses_ms) / 1000 / elapsed_s if elapsed_s else 0.0,
        "pauses_ms": pauses_ms,
    }


def table(rows: Sequence[dict[str, Any]], duration_s: float) -> Table:
    t = Table(title=f"full collections in the gateway, {duration_s:.0f} s closed loop")
    for name in ("gateway", "requests", "req/s", "errors", "full GCs", "pause p50 ms",
                 "pause max ms", "time paused"):  # fmt: skip
        t.add_column(name, justify="left" if name == "gateway" else "right")
    for r in rows:
        t.add_row(
            r["label"],
            f"{r['requests']:,}",
            f"{r['requests_per_s']:.0f}",
            str(r["errors"]),
            str(r["full_collections"]),
            f"{r['pause_p50_ms']:.1f}",
            f"{r['pause_max_ms']:.1f}",
            f"{r['paused_share']:.1%}",
        )
    return t


def main(argv: Sequence[str] | None = None) -> int:
    parser = harness.parser("gc_pauses", "Full garbage collections in the gateway under load.")
    parser.add_argument("--baseline", metavar="REF", help="also run the gateway at git REF")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_DURATION_S:.0f} s each")
    parser.add_argument("--duration-s", type=float, default=None)
    parser.add_argument("--out", type=Path, default=OUT_PATH)
    args = parser.parse_args(argv)
    duration_s = args.duration_s or (QUICK_DURATION_S if args.quick else DURATION_S)
    console = harness.console(width=120)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-gc-"))
    specs = [RouterSpec("cachelane", "cache_aware")]
    if args.baseline:
        specs.append(baseline_tree(args.baseline, log_dir))
    settings = SimFleetSettings(
        replicas=REPLICAS, hbm_capacity_tokens=HBM_CAPACITY_TOKENS, time_factor=0.0, itl_ms=0.0
    )
    rows = []
    with sim_fleet(settings, log_dir) as fleet:
        for spec in specs:
            rows.append(run_one(spec, fleet.urls, log_dir, duration_s))
            r = rows[-1]
            console.print(
                f"  {r['label']}: {r['requests']:,} requests, {r['full_collections']} full"
                f" collections, max {r['pause_max_ms']:.0f} ms"
            )
    console.print(table(rows, duration_s))
    report.write_json(args.out, {"duration_s": duration_s, "clients": CLIENTS, "rows": rows})
    console.print(f"wrote {args.out}; logs in {log_dir}/")
    return 0 if all(r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
