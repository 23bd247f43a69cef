"""The cyclic GC and a gateway that runs for weeks.

CPython's full collection walks every object the GC tracks. A gateway's imports (FastAPI,
pydantic, aiohttp, prometheus_client...) leave ~100k of them, alive for the life of the process,
and at a few hundred requests per second a full collection came every ~2 s and took 70-120 ms
(docs/performance.md): every request in flight waited for it. `gc.freeze()` moves what exists at
start-up to a generation no collection walks (what CPython's documentation suggests for a
long-lived process's start-up objects); what the gateway allocates afterwards is collected as
usual. The KV index keeps its own tables out of the GC's sight (routing/index.py).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then exempt every object alive now from later collections."""
    gc.collect()
    gc.freeze()
