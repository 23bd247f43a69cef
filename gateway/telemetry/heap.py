"""The cyclic GC and a gateway that runs for weeks.

CPython's full collection walks every object the GC tracks. A gateway's imports (FastAPI,
pydantic, aiohttp, prometheus_client...) leave ~100k of them, alive for the life of the process,
and under load full collections come every few seconds whatever is tracked, so walking those
objects is a pause every request in flight waits for (`python -m loadtest.bench.gc_pauses`
measures it; docs/bench/gc_pauses.md). `gc.freeze()` moves what exists at
start-up to a generation no collection walks (what CPython's documentation suggests for a
long-lived process's start-up objects); what the gateway allocates afterwards is collected as
usual. The KV index keeps its own tables out of the GC's sight (routing/index.py). What is left
is measured: cachelane_gc_pause_seconds (CollectionTimer).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import time
from collections.abc import Iterator

from prometheus_client.core import HistogramMetricFamily


def freeze_startup_heap() -> None:
    """Collect once, then exempt every object alive now from later collections."""
    gc.collect()
    gc.freeze()


GC_PAUSE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
GENERATIONS = (0, 1, 2)


class CollectionTimer:
    """Times the cyclic GC's collections per generation (a `gc.callbacks` entry while installed)
    and exposes them as the histogram cachelane_gc_pause_seconds{generation}.

    The callback only adds to plain ints: it runs wherever an allocation starts a collection,
    possibly inside a metric's own locked update, so it must not take a lock; the histogram is
    built from those counts when the registry is collected (a scrape)."""

    def __init__(self) -> None:
        self._started = 0.0
        self._buckets = {g: [0] * (len(GC_PAUSE_BUCKETS_S) + 1) for g in GENERATIONS}
        self._sums = dict.fromkeys(GENERATIONS, 0.0)

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        generation = info["generation"]
        self._sums[generation] += seconds
        self._buckets[generation][bisect.bisect_left(GC_PAUSE_BUCKETS_S, seconds)] += 1

    def install(self) -> None:
        gc.callbacks.append(self)

    def uninstall(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            "cachelane_gc_pause_seconds",
            "Time the process (its event loop) was stopped by the cyclic garbage collector, "
            "per generation",
            labels=["generation"],
        )
        bounds = [*map(str, GC_PAUSE_BUCKETS_S), "+Inf"]
        for generation in GENERATIONS:
            cumulative = itertools.accumulate(self._buckets[generation])
            family.add_metric(
                [str(generation)],
                list(zip(bounds, cumulative, strict=True)),
                self._sums[generation],
            )
        yield family
