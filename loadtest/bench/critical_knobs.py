"""The pinned pool's knobs on the critical benchmark (docs/critical.md, "Knobs"): the arms of
`python -m loadtest.bench.critical`, with two arms' configs replaced.

  static-pinning  -> the `priority` arm's config with its HBM-only pool `pinned: true` and
                     nothing else: the pinned pool with default knobs (cost placement, lending);
  flow-control    -> the same plus the knobs kept from the one-prefill-at-a-time engine:
                     lend_keep_idle 1, lend_max_prefill_tokens 2000, clear_while_loading.

The other arms (no-tenants, priority, sglang, vllm) are as the benchmark builds them. Every
option of the benchmark applies, e.g.:

  python -m loadtest.bench.critical_knobs --arms priority,static-pinning,flow-control \\
      --duration-s 20 --warmup-s 5 --seed 1 --out results/bench_critical_knobs.json
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from loadtest.bench import critical

KNOBS = {"lend_keep_idle": 1, "lend_max_prefill_tokens": critical.PINNED_MAX_PREFILL_TOKENS}
_benchmark_config = critical.gateway_config


def knob_config(fleet: critical.Fleet, arm: str) -> dict[str, Any]:
    if arm not in ("static-pinning", "flow-control"):
        return _benchmark_config(fleet, arm)
    base = _benchmark_config(fleet, "priority")  # tenants, engine priority, flow control
    pools = list(base["pools"])
    pools[0] = {**pools[0], "name": "pinned", "pinned": True}
    critical_keys: dict[str, Any] = {}
    if arm == "flow-control":
        pools[0] = {**pools[0], **KNOBS}
        critical_keys = {"clear_while_loading": True}
    return {**base, "pools": pools, "critical": critical_keys}


def main(argv: Sequence[str] | None = None) -> int:
    critical.gateway_config = knob_config
    return critical.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
