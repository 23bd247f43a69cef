"""`cachelane plan CAPTURE`: what the captured traffic would see on other set-ups.

The edge around routing/whatif/ (pure): read the capture (gateway/accounting/capture.py wrote it),
take the fitted cost terms from it, from a running gateway (--gateway: POST /debug/route, the terms
in use per replica) or from the fits the gateways share in Redis (--redis:
gateway/accounting/fit_store.py), replay it on each scenario, search the replicas each class's TTFT
target needs, and print a table;
--json writes the numbers, --png a comparison (matplotlib: the [sim] extra).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx
from redis.exceptions import RedisError

from gateway.cli.text_table import Out, Printer, TextTable
from gateway.config import ClassesConfig
from gateway.extras import install_hint
from routing.cost import CostTerms
from routing.whatif.capture import Capture, CaptureError, parse_capture
from routing.whatif.replay import Outcome, replay
from routing.whatif.setup import Setup, scenarios
from routing.whatif.summary import ALL, MAX_REPLICAS, Needed, replicas_needed, summarize

HOST_RAM_PER_HBM = 2
# A scenario's CPU tier where the capture had none: 2x the replica's HBM KV capacity. GPU servers
# carry about twice their GPU memory as host RAM (NVIDIA DGX H200: 2 TB of system memory for
# 8 x 141 GB of HBM), and an offload tier gets a share of it; say --cpu-tokens for yours.

DEFAULT_REMOTE_TOKENS = 10_000_000  # the gateway's remote_tiers[].capacity_tokens default

HTTP_TIMEOUT_S = 5.0
GB = 1e9


def read_capture(path: Path) -> Capture:
    lines = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                lines.append(json.loads(line))
            except ValueError:
                if n > 1 and not f.readline():  # a last line cut short (the gateway was killed)
                    break
                raise CaptureError(f"line {n} is not JSON") from None
    return parse_capture(lines)


def gateway_fit(url: str, api_key: str | None, capture: Capture) -> Capture:
    """The capture with the fitted terms a running gateway uses now (POST /debug/route)."""
    model = capture.requests[0].model if capture.requests else "default"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "messages": [{"role": "user", "content": "cachelane plan"}]}
    resp = httpx.post(f"{url}/debug/route", json=body, headers=headers, timeout=HTTP_TIMEOUT_S)
    resp.raise_for_status()
    pools = {name: p.name for p in capture.header.pools for name in p.replica_names}
    fit: dict[str, CostTerms] = {}
    for name, t in resp.json()["costs"]["replicas"].items():
        fit[name] = CostTerms(
            t["fixed_ms"] / 1000,
            1 / t["prefill_tokens_per_s"],
            1 / t["swap_tokens_per_s"],
            1 / t["fetch_tokens_per_s"],
            samples=int(t.get("samples", 0)),
        )
        pools.setdefault(name, next(iter(pools.values()), ""))
    return replace(capture, fit=fit, fit_pools=pools)


def redis_fit(url: str, capture: Capture) -> Capture:
    """The capture with the fits the gateways share in Redis (gateway/accounting/fit_store.py): per
    replica and per pool, each resumed on its pool's seed (a fit seeded from other constants is
    skipped)."""
    import redis

    from gateway.accounting.fit_store import FITS_KEY
    from routing.learn import OnlineFit

    client = redis.Redis.from_url(url, socket_timeout=HTTP_TIMEOUT_S)
    try:
        raw = client.hgetall(FITS_KEY)
    finally:
        client.close()
    seeds = {p.name: CostTerms.seed(p.costs) for p in capture.header.pools}
    replica_pool = {name: p.name for p in capture.header.pools for name in p.replica_names}
    fit: dict[str, CostTerms] = {}
    pools: dict[str, str] = {}
    for key, value in raw.items():
        name = key.decode() if isinstance(key, bytes) else str(key)
        pool = name.removeprefix("pool:") if name.startswith("pool:") else replica_pool.get(name)
        if pool not in seeds:
            continue
        try:
            state = json.loads(value)
        except ValueError:
            continue
        resumed = OnlineFit.from_dict(seeds[pool], state)
        if resumed.samples:
            fit[name], pools[name] = resumed.terms(), pool
    return replace(capture, fit=fit, fit_pools=pools)


def _targets(given: Sequence[str]) -> dict[str, float]:
    """CLASS=MS pairs; by default the gateway's class budgets (classes.*.ttft_budget_ms)."""
    defaults = ClassesConfig()
    out = {
        k: v
        for k in ("critical", "standard", "batch")
        if (v := getattr(defaults, k).ttft_budget_ms) is not None
    }
    for item in given:
        klass, sep, ms = item.partition("=")
        if not sep:
            raise ValueError(f"--target {item!r}: expected CLASS=MS")
        out[klass] = float(ms)
    return out


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="cachelane plan")
    p.description = (
        "Replay a traffic capture (config capture.path) on alternative set-ups: TTFT, hit "
        "rate by tier, PCIe and network bytes, remote writes never read, replicas needed."
    )
    p.add_argument("capture", type=Path, help="the capture file (JSON lines)")
    p.add_argument(
        "--scenarios",
        default="captured,hbm,cpu,remote-reuse,remote-always,pinned,hbm-x0.5,hbm-x2",
        help="which, in order (default: %(default)s)",
    )
    p.add_argument(
        "--cpu-tokens",
        type=int,
        help=f"CPU tier per replica where the capture had none (default: {HOST_RAM_PER_HBM}x HBM)",
    )
    p.add_argument(
        "--remote-tokens",
        type=int,
        help=f"remote tier capacity if the capture had none (default {DEFAULT_REMOTE_TOKENS})",
    )
    p.add_argument(
        "--remote-lookup-ms",
        type=float,
        default=0.0,
        help="a remote tier's lookup round trip, paid by every request that misses locally, in "
        "scenarios that add the tier (default 0: the cost model has no such term)",
    )
    p.add_argument("--pin-replicas", type=int, default=1, help="pinned pool size (default 1)")
    p.add_argument(
        "--critical-tenant",
        action="append",
        default=[],
        help="serve this tenant as critical in the pinned scenario (repeatable)",
    )
    p.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="CLASS=MS",
        help="TTFT p99 target of a class (default: the gateway's class budgets)",
    )
    p.add_argument("--no-search", action="store_true", help="skip the replica-count search")
    p.add_argument("--seed", type=int, default=0, help="routing's tie-break seed (default 0)")
    p.add_argument("--gateway", help="take the fitted cost terms from this running gateway")
    p.add_argument(
        "--redis", help="take the fitted cost terms the gateways share in this Redis (redis://)"
    )
    p.add_argument("--api-key", help="the admin key of --gateway (its /debug/route needs it)")
    p.add_argument("--json", type=Path, help="write the numbers here")
    p.add_argument("--png", type=Path, help="write a comparison plot here (the [sim] extra)")
    return p


def plan(args: argparse.Namespace, console: Printer) -> dict[str, Any]:
    capture = read_capture(args.capture)
    if args.gateway:
        capture = gateway_fit(args.gateway, args.api_key, capture)
    elif args.redis:
        capture = redis_fit(args.redis, capture)
    base = Setup.from_capture(capture)
    hbm = max((p.hbm_capacity_tokens for p in base.pools), default=0)
    cpu = args.cpu_tokens or max(
        max((p.cpu_capacity_tokens for p in base.pools), default=0), HOST_RAM_PER_HBM * hbm
    )
    remote = args.remote_tokens or max(base.remote_tiers.values(), default=DEFAULT_REMOTE_TOKENS)
    table = scenarios(
        cpu_tokens=cpu,
        remote_tokens=remote,
        pin_replicas=args.pin_replicas,
        critical_tenants=frozenset(args.critical_tenant),
        remote_lookup_s=args.remote_lookup_ms / 1000,
    )
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown scenarios {unknown}; known: {sorted(table)}")
    targets = _targets(args.target)
    fit_source = "gateway" if args.gateway else "redis" if args.redis else "capture"
    fit_source = fit_source if capture.fit else "config"
    console.print(
        f"{len(capture.requests)} requests over {_span_s(capture):.0f} s; cost terms from the "
        f"{fit_source}; targets (TTFT p99): "
        + ", ".join(f"{k} {v:.0f} ms" for k, v in targets.items())
    )
    out: dict[str, Any] = {"fit_source": fit_source, "targets_ms": targets, "scenarios": {}}
    for name in names:
        setup = table[name](base)
        outcome = replay(capture.requests, setup, seed=args.seed)
        summary = summarize(outcome)
        needed = {} if args.no_search else _search(capture, setup, outcome, targets, args.seed)
        out["scenarios"][name] = {
            "label": setup.name,
            "summary": summary.to_dict(),
            "replicas_needed": {k: None if v is None else asdict(v) for k, v in needed.items()},
        }
    return out


def _span_s(capture: Capture) -> float:
    r = capture.requests
    return r[-1].t_s - r[0].t_s if len(r) > 1 else 0.0


def _search(
    capture: Capture, setup: Setup, outcome: Outcome, targets: dict[str, float], seed: int
) -> dict[str, Needed | None]:
    classes = sorted({r.tenant_class for r in outcome.requests})
    cache: dict[tuple[str, int], Outcome] = {}
    return {
        k: replicas_needed(capture.requests, setup, k, targets[k], seed=seed, cache=cache)
        for k in classes
        if k in targets
    }


def print_plan(result: dict[str, Any], console: Printer) -> None:
    table = TextTable("cachelane plan")
    table.add_column("scenario")
    table.add_column("class")
    for col in (
        "requests",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "hit HBM/CPU/remote",
        "PCIe GB",
        "net read GB",
        "net written GB",
        "never read GB",
        "replicas for target",
    ):
        table.add_column(col, right=True)
    for entry in result["scenarios"].values():
        s = entry["summary"]
        needed = entry["replicas_needed"]
        for klass, c in s["classes"].items():
            n = needed.get(klass)
            if n is None:
                need = "-"
            elif n["replicas"] is None:
                need = f"> {MAX_REPLICAS} ({n['pool']})"
            else:
                need = f"{n['replicas']} ({n['pool']})"
            fleet = klass == ALL
            table.add_row(
                entry["label"] if klass == next(iter(s["classes"])) else "",
                klass,
                str(c["requests"]) + (f" ({c['rejected']} rejected)" if c["rejected"] else ""),
                _ms(c["ttft_p50_ms"]),
                _ms(c["ttft_p99_ms"]),
                f"{c['hbm_hit_rate']:.0%}/{c['cpu_hit_rate']:.0%}/{c['remote_hit_rate']:.0%}",
                f"{c['pcie_bytes'] / GB:.1f}",
                f"{c['network_read_bytes'] / GB:.1f}",
                f"{c['network_written_bytes'] / GB:.1f}",
                f"{s['remote_never_read_bytes'] / GB:.1f}" if fleet else "",
                need,
            )
        table.add_section()
    console.print(str(table))


def _ms(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.0f}"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["scenarios"])
    labels = [result["scenarios"][n]["label"] for n in names]
    classes = sorted(
        {k for n in names for k in result["scenarios"][n]["summary"]["classes"] if k != ALL}
    )
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    width = 0.8 / max(1, len(classes))
    x = list(range(len(names)))
    for ax, metric, title in (
        (axes[0][0], "ttft_p50_ms", "TTFT p50 (ms)"),
        (axes[0][1], "ttft_p99_ms", "TTFT p99 (ms)"),
    ):
        for i, klass in enumerate(classes):
            values = [
                result["scenarios"][n]["summary"]["classes"].get(klass, {}).get(metric, math.nan)
                for n in names
            ]
            ax.bar([v + i * width for v in x], values, width, label=klass)
        for klass, target in result["targets_ms"].items():
            if klass in classes and metric == "ttft_p99_ms":
                ax.axhline(target, linestyle="--", linewidth=0.8, color="grey")
        ax.set_title(title)
        centres = [v + width * (len(classes) - 1) / 2 for v in x]
        ax.set_xticks(centres, labels, rotation=25, ha="right")
        ax.legend()
    ax = axes[1][0]
    bottom = [0.0] * len(names)
    for tier in ("hbm", "cpu", "remote"):
        values = [
            result["scenarios"][n]["summary"]["classes"][ALL][f"{tier}_hit_rate"] for n in names
        ]
        ax.bar(x, values, 0.6, bottom=bottom, label=tier.upper() if tier != "remote" else tier)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_title("prompt tokens served from each tier (all classes)")
    ax.set_xticks(x, labels, rotation=25, ha="right")
    ax.legend()
    ax = axes[1][1]
    kinds = (
        ("pcie_bytes", "PCIe swap-in"),
        ("network_read_bytes", "remote read"),
        ("network_written_bytes", "remote written"),
    )
    width = 0.2
    for i, (key, label) in enumerate(kinds):
        values = [result["scenarios"][n]["summary"]["classes"][ALL][key] / GB for n in names]
        ax.bar([v + i * width for v in x], values, width, label=label)
    never = [result["scenarios"][n]["summary"]["remote_never_read_bytes"] / GB for n in names]
    ax.bar([v + 3 * width for v in x], never, width, label="remote never read")
    ax.set_title("bytes moved (GB)")
    ax.set_xticks([v + 1.5 * width for v in x], labels, rotation=25, ha="right")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Out()
    try:
        result = plan(args, console)
    except (OSError, CaptureError, ValueError, httpx.HTTPError, RedisError) as err:
        print(f"cachelane plan: {err}", file=sys.stderr)
        return 2
    print_plan(result, console)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        console.print(f"wrote {args.json}")
    if args.png:
        try:
            plot(result, args.png)
        except ImportError:
            print(f"cachelane plan: --png needs matplotlib ({install_hint('sim')})")
            return 2
        console.print(f"wrote {args.png}")
    return 0
