"""Tier decisions on the simulated fleet: pinned HBM-only pools and remote-tier admission.

    python -m loadtest.bench.tiers [--quick]

(a) A critical voice tenant (short turns, one system prompt, modest rate) while a burst of standard
    traffic with long, partly offloaded prefixes saturates the fleet: with a pinned HBM-only pool
    for the critical tenant vs one shared pool, the same number of replicas in both arms.
(b) Remote-tier admission: `remote_write: never | always | reuse` on a low-reuse, a high-reuse and
    a low-reuse-behind-a-shared-header workload, replicas with CPU tiers and one remote tier.

Each arm replays one seeded trace open-loop through a fresh gateway
(loadtest/bench/tier_experiment.py); prints the tables and writes results/bench_tiers.json and
results/bench_tiers.png. Compare arms as ratios within one run: the machine's 2 cores are shared
with everything else running on it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from loadtest.bench import harness, tier_report
from loadtest.bench.tier_experiment import (
    ArmResult,
    PinningSetup,
    ReuseSetup,
    reuse_fleet,
    run_pinning,
    run_reuse_arm,
)
from loadtest.workloads import tier_traces, traces
from routing.hashing import DEFAULT_BLOCK_SIZE_TOKENS

PINNING_DURATION_S = 20.0
REUSE_DURATION_S = 20.0
QUICK_DURATION_S = 4.0
# Arms of ~20 s (2 pinning arms + 3 x 3 admission arms, plus start-up: ~5 minutes); --quick runs
# a few seconds per arm to check the machinery, not to measure.

MODES = ("never", "always", "reuse")


def build_parser() -> argparse.ArgumentParser:
    p = harness.parser(
        "tiers",
        "Pinned HBM-only pools and remote-tier admission on the simulated fleet.",
        quick=f"{QUICK_DURATION_S:.0f} s per arm",
    )
    add = p.add_argument
    add("--pinning-duration-s", type=float, default=None, help="(default: 20, --quick 4)")
    add("--reuse-duration-s", type=float, default=None, help="(default: 20, --quick 4)")
    harness.add_names(p, "--shapes", tier_traces.REUSE_SHAPES, "")
    harness.add_names(p, "--modes", MODES, "remote_write modes")
    add("--skip-pinning", action="store_true")
    add("--skip-reuse", action="store_true")
    harness.add_seed_and_out(p, Path("results/bench_tiers.json"))
    return p


def _duration(value: float | None, quick: bool, default: float) -> float:
    if value is not None:
        return value
    return QUICK_DURATION_S if quick else default


def run_pinning_section(
    console: Console, duration_s: float, seed: int, log_dir: Path
) -> tuple[dict[str, ArmResult], dict[str, Any]]:
    voice = tier_traces.voice(tier_traces.VOICE_RATE_PER_S, duration_s, seed)
    standard = tier_traces.standard_burst(tier_traces.STANDARD_RATE, duration_s, seed)
    setup = PinningSetup()
    console.print(
        f"(a) {len(voice)} critical + {len(standard)} standard requests over {duration_s:.0f} s; "
        f"{setup.replicas} replicas per arm ({setup.pinned} pinned HBM-only in arm `pinned`)"
    )
    arms = run_pinning(setup, voice, standard, log_dir)
    info = {
        "duration_s": duration_s,
        "voice_rate_per_s": tier_traces.VOICE_RATE_PER_S,
        "standard_rate": {
            "base_per_s": tier_traces.STANDARD_RATE.base_per_s,
            "burst_per_s": tier_traces.STANDARD_RATE.burst_per_s,
            "burst_window": list(tier_traces.STANDARD_RATE.window),
        },
        "setup": _fields(setup),
        "requests": {"critical": len(voice), "standard": len(standard)},
    }
    return arms, info


def run_reuse_section(
    console: Console,
    shapes: Sequence[str],
    modes: Sequence[str],
    duration_s: float,
    seed: int,
    log_dir: Path,
) -> tuple[dict[str, dict[str, ArmResult]], dict[str, Any]]:
    setup = ReuseSetup()
    out: dict[str, dict[str, ArmResult]] = {}
    workloads: dict[str, Any] = {}
    for shape in shapes:
        trace = tier_traces.reuse(shape, tier_traces.REUSE_RATE_PER_S, duration_s, seed)
        ideal = traces.ideal_hits(trace, DEFAULT_BLOCK_SIZE_TOKENS)
        workloads[shape] = {
            "requests": len(trace),
            "ideal_hit_rate": ideal.hit_rate,
            "prompt_tokens": ideal.prompt_tokens,
        }
        console.print(
            f"(b) {shape}: {len(trace)} requests over {duration_s:.0f} s, ideal hit rate "
            f"{ideal.hit_rate:.1%}; modes {', '.join(modes)}"
        )
        with reuse_fleet(setup, log_dir, f"reuse-{shape}") as fleet:
            out[shape] = {
                mode: run_reuse_arm(setup, fleet, trace, mode, log_dir, f"reuse-{shape}-{mode}")
                for mode in modes
            }
    info = {
        "duration_s": duration_s,
        "rate_per_s": tier_traces.REUSE_RATE_PER_S,
        "setup": _fields(setup),
        "workloads": workloads,
    }
    return out, info


def _fields(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}


def payload(
    pinning: dict[str, ArmResult],
    pinning_info: dict[str, Any],
    reuse: dict[str, dict[str, ArmResult]],
    reuse_info: dict[str, Any],
    wall_s: float,
) -> dict[str, Any]:
    return {
        "pinning": {
            **pinning_info,
            "arms": {name: arm.to_dict() for name, arm in pinning.items()},
            "ratios_pinned_over_unpinned": tier_report.pinning_ratios(pinning),
        }
        if pinning
        else None,
        "remote_admission": {
            **reuse_info,
            "results": {
                shape: {mode: arm.to_dict() for mode, arm in modes.items()}
                for shape, modes in reuse.items()
            },
        }
        if reuse
        else None,
        "wall_time_s": wall_s,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = harness.console(width=140)
    shapes = [s for s in args.shapes.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    bad = [s for s in shapes if s not in tier_traces.REUSE_SHAPES] + [
        m for m in modes if m not in MODES
    ]
    if bad:
        console.print(f"[red]bench_tiers: unknown shapes or modes {bad}")
        return 2
    out: Path = args.out
    log_dir = harness.log_dir(out)
    started = time.perf_counter()
    pinning: dict[str, ArmResult] = {}
    reuse: dict[str, dict[str, ArmResult]] = {}
    pinning_info: dict[str, Any] = {}
    reuse_info: dict[str, Any] = {}

    def run_arms() -> None:
        if not args.skip_pinning:
            duration = _duration(args.pinning_duration_s, args.quick, PINNING_DURATION_S)
            ran, info = run_pinning_section(console, duration, args.seed, log_dir)
            pinning.update(ran)
            pinning_info.update(info)
            console.print(tier_report.pinning_table(pinning))
        if not args.skip_reuse:
            duration = _duration(args.reuse_duration_s, args.quick, REUSE_DURATION_S)
            ran_reuse, info = run_reuse_section(
                console, shapes, modes, duration, args.seed, log_dir
            )
            reuse.update(ran_reuse)
            reuse_info.update(info)
            console.print(tier_report.reuse_table(reuse))

    code = harness.run_arms(console, "bench_tiers", run_arms)
    if code:
        return code
    wall_s = time.perf_counter() - started
    harness.write_results(
        console,
        out,
        payload(pinning, pinning_info, reuse, reuse_info, wall_s),
        lambda png: tier_report.plot(
            png, pinning, reuse, title="cachelane tier decisions (simulated fleet)"
        ),
        wall_s,
        log_dir,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
