"""`cachelane report URL [URL ...]`: where the cost of offloading landed, from running gateways.

Each gateway's GET /debug/costs (admin key; none in auth.mode open) for one window is fetched and
merged (sums added: every gateway accounts for the requests it proxied); with `--redis URL`, the
windows the gateways sharing that Redis published (gateway/accounting/ledger_store.py). Then
printed per tenant class: the TTFT by layer, the cache hits by tier, the bytes that crossed PCIe
and the network, the prefill GPU-seconds avoided, and the findings
(gateway/accounting/findings.py) in plain words. `--png` draws the same as a chart (matplotlib:
the [report] extra); `--json` prints the merged numbers instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from gateway.accounting.findings import (
    Finding,
    by_class,
    by_tenant,
    class_order,
    findings,
    gib,
    merge,
    pct,
    share,
)
from gateway.cli.text_table import Out, Printer, TextTable
from gateway.extras import install_hint
from routing.accounting import LAYERS, WINDOWS_S

ADMIN_KEY_ENV = "CACHELANE_ADMIN_KEY"
FETCH_TIMEOUT_S = 10.0  # one JSON document from a gateway on the same network
_UNITS = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_window(text: str) -> float:
    """ "15m", "1h", "90s" or a number of seconds; at most the longest window kept (1 h)."""
    raw = text.strip().lower()
    for suffix in sorted(_UNITS, key=len, reverse=True):
        if raw.endswith(suffix):
            number, factor = raw[: -len(suffix)], _UNITS[suffix]
            break
    else:
        number, factor = raw, 1.0
    try:
        seconds = float(number) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a window (e.g. 60s, 15m, 1h)") from None
    if not 0 < seconds <= max(WINDOWS_S):
        raise argparse.ArgumentTypeError(f"a window is in (0, {max(WINDOWS_S):g}] seconds")
    return seconds


def _auth(admin_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {admin_key}"} if admin_key else {}


def fetch_windows(
    urls: Sequence[str], admin_key: str | None, window_s: float
) -> list[dict[str, Any]]:
    """Each gateway's window; raises RuntimeError naming the gateway that failed, why, and what
    to change when the fault is the key."""
    out = []
    with httpx.Client(timeout=FETCH_TIMEOUT_S, trust_env=False) as client:
        for url in urls:
            try:
                resp = client.get(
                    f"{url.rstrip('/')}/debug/costs",
                    params={"window_s": window_s},
                    headers=_auth(admin_key),
                )
            except httpx.HTTPError as err:
                raise RuntimeError(f"{url}: {err}") from None
            if resp.status_code != 200:
                hint = _key_hint(resp.status_code, admin_key)
                raise RuntimeError(f"{url}: {resp.status_code}: {_message(resp)}{hint}")
            out.append(resp.json()["windows"][0])
    return out


def _key_hint(status: int, admin_key: str | None) -> str:
    """What to change when a gateway refused the report for its key."""
    if status == 401 and not admin_key:
        return (
            f"; the gateway checks keys (auth.mode keys): give --admin-key or set "
            f"{ADMIN_KEY_ENV} to its admin key (config admin.api_key)"
        )
    if status == 401:
        return "; that is not the gateway's admin key (config admin.api_key)"
    if status == 404:
        return (
            "; the gateway has no admin key: set admin.api_key (or admin.api_key_sha256) in its "
            "config, or run it with auth.mode open, where the report needs no key"
        )
    return ""


def pinned_pool_hints(urls: Sequence[str], admin_key: str | None) -> list[str]:
    """Each gateway's undersized-pinned-pool hint from its /ready (gateway/serving/pinning.py), if
    it has one. Best effort: a gateway that does not answer gives none (its costs were fetched)."""
    out = []
    with httpx.Client(timeout=FETCH_TIMEOUT_S, trust_env=False) as client:
        for url in urls:
            try:
                resp = client.get(f"{url.rstrip('/')}/ready", headers=_auth(admin_key))
                hint = resp.json().get("pinned_pool", {}).get("hint")
            except (httpx.HTTPError, ValueError, AttributeError):
                continue
            if hint:
                out.append(f"{url}: {hint}")
    return out


def fetch_shared(redis_url: str, window_s: float) -> tuple[list[dict[str, Any]], float]:
    """The windows the gateways on this Redis published (gateway/accounting/ledger_store.py)."""
    import time

    from redis import Redis
    from redis.exceptions import RedisError

    from gateway.accounting.ledger_store import COSTS_KEY, shared_windows

    try:
        with Redis.from_url(redis_url, socket_timeout=FETCH_TIMEOUT_S) as redis:
            raw = redis.hgetall(COSTS_KEY)
    except RedisError as err:
        raise RuntimeError(f"{redis_url}: {err}") from None
    windows, shared_s = shared_windows(raw, window_s, time.time())
    if not windows:
        raise RuntimeError(f"{redis_url}: no gateway has published its accounting recently")
    return windows, shared_s


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:200]


def _ms(seconds: float, requests: float) -> str:
    return f"{1000 * seconds / requests:.1f}" if requests else "-"


def render(merged: Mapping[str, Any], found: Sequence[Finding], console: Printer) -> None:
    classes = by_class(merged["rows"])
    window = merged["window_s"]
    console.print(f"Where the cost of offloading landed (last {window:g} s)")
    ttft = TextTable("TTFT by layer, mean ms per streamed request (share of TTFT)")
    for col in ("class", "requests", "TTFT", *LAYERS):
        ttft.add_column(col, right=col != "class")
    hits = TextTable("Prompt tokens by where their KV came from; bytes moved; prefill avoided")
    for col in (
        "class", "HBM", "CPU", "remote", "computed", "PCIe", "swap-ins shared",
        "remote written", "read", "never read", "GPU-s avoided",
    ):  # fmt: skip
        hits.add_column(col, right=col != "class")
    for klass in class_order(list(classes)):
        s = classes[klass]
        timed, total = s.get("timed_requests", 0.0), s.get("observed_ttft_s", 0.0)
        spent = [s.get(f"{layer}_s", 0.0) for layer in LAYERS]
        layers = [f"{_ms(v, timed)} ({pct(share(v, total))})" for v in spent]
        ttft.add_row(klass, f"{s.get('requests', 0):.0f}", _ms(total, timed), *layers)
        prompt = s.get("prompt_tokens", 0.0)
        tiers = [pct(share(s.get(f"{t}_tokens", 0.0), prompt)) for t in ("hbm", "cpu", "remote")]
        avoided = sum(s.get(f"avoided_{t}_s", 0.0) for t in ("hbm", "cpu", "remote"))
        hits.add_row(
            klass,
            *tiers,
            pct(share(s.get("computed_tokens", 0.0), prompt)),
            gib(s.get("pcie_bytes", 0.0)),
            pct(share(s.get("shared_swap_ins", 0.0), s.get("swap_ins", 0.0))),
            gib(s.get("remote_written_bytes", 0.0)),
            gib(s.get("remote_read_bytes", 0.0)),
            gib(s.get("remote_never_read_bytes", 0.0)),
            f"{avoided:.2f}",
        )
    console.print(str(ttft))
    console.print(str(hits))
    tenants = TextTable("By tenant")
    for col in (
        "tenant",
        "class",
        "requests",
        "TTFT ms",
        "hit rate",
        "remote written",
        "never read",
    ):
        tenants.add_column(col, right=col not in ("tenant", "class"))
    for (tenant, klass), s in sorted(by_tenant(merged["rows"]).items()):
        tenants.add_row(
            tenant,
            klass,
            f"{s.get('requests', 0):.0f}",
            _ms(s.get("observed_ttft_s", 0.0), s.get("timed_requests", 0.0)),
            pct(share(s.get("cached_tokens", 0.0), s.get("prompt_tokens", 0.0))),
            gib(s.get("remote_written_bytes", 0.0)),
            gib(s.get("remote_never_read_bytes", 0.0)),
        )
    console.print(str(tenants))
    console.print("Findings")
    for f in found:
        console.print(f"- {f.text}")


def draw(merged: Mapping[str, Any], path: Path) -> None:
    """Three panels per class: mean TTFT by layer, GiB moved, GPU-seconds avoided by tier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = by_class(merged["rows"])
    names = class_order(list(classes))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    _stacked(
        axes[0],
        names,
        {
            layer: [
                1000
                * share(classes[c].get(f"{layer}_s", 0.0), classes[c].get("timed_requests", 0.0))
                for c in names
            ]
            for layer in LAYERS
        },
        "mean TTFT by layer (ms)",
    )
    moved = {
        "PCIe": "pcie_bytes",
        "remote written": "remote_written_bytes",
        "remote read": "remote_read_bytes",
        "written, never read": "remote_never_read_bytes",
    }
    width = 0.8 / len(moved)
    for i, (label, name) in enumerate(moved.items()):
        axes[1].bar(
            [x + i * width for x in range(len(names))],
            [classes[c].get(name, 0.0) / 2**30 for c in names],
            width,
            label=label,
        )
    axes[1].set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names)
    axes[1].set_title("bytes moved (GiB)")
    axes[1].legend(fontsize=8)
    _stacked(
        axes[2],
        names,
        {
            t: [classes[c].get(f"avoided_{t}_s", 0.0) for c in names]
            for t in ("hbm", "cpu", "remote")
        },
        "prefill GPU-s avoided by tier",
    )
    fig.suptitle(f"where the cost of offloading landed, last {merged['window_s']:g} s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _stacked(
    ax: Any, names: Sequence[str], series: Mapping[str, Sequence[float]], title: str
) -> None:
    bottom = [0.0] * len(names)
    for label, values in series.items():
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_title(title)
    ax.legend(fontsize=8)


def as_json(merged: Mapping[str, Any], found: Sequence[Finding]) -> dict[str, Any]:
    def labels(key: tuple[str, str, str]) -> dict[str, str]:
        return dict(zip(("tenant", "tenant_class", "pool"), key, strict=True))

    tiers = [
        {
            **{k: v for k, v in tier.items() if k != "resident_unread_bytes"},
            "resident_unread_bytes": [
                {**labels(k), "bytes": v} for k, v in sorted(tier["resident_unread_bytes"].items())
            ],
        }
        for tier in merged["remote_tiers"].values()
    ]
    return {
        "window_s": merged["window_s"],
        "rows": [{**labels(k), "sums": s} for k, s in sorted(merged["rows"].items())],
        "pools": list(merged["pools"].values()),
        "remote_tiers": tiers,
        "findings": [{"rule": f.rule, "text": f.text} for f in found],
    }


def add_parser(sub: Any) -> None:
    """Register `report` on the CLI's subcommands."""
    p = sub.add_parser(
        "report",
        help="where the cost of offloading landed, from running gateways' /debug/costs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("urls", nargs="*", metavar="URL", help="gateway base URLs (merged)")
    p.add_argument(
        "--redis",
        metavar="URL",
        help="instead of URLs: every gateway sharing this Redis (index.backend redis) publishes "
        "its accounting there; they are merged (windows of 1 min, 15 min or 1 h)",
    )
    p.add_argument(
        "--admin-key",
        help=f"the gateways' admin key (default: ${ADMIN_KEY_ENV}; none in auth.mode open)",
    )
    p.add_argument(
        "--window", type=parse_window, default=900.0, help="60s, 15m (default), 1h, or seconds"
    )
    p.add_argument("--png", type=Path, help="also draw the report to this PNG (matplotlib)")
    p.add_argument("--json", action="store_true", help="print the merged numbers as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if bool(args.urls) == bool(args.redis):
        print("cachelane report: give gateway URLs or --redis URL", file=sys.stderr)
        return 2
    key = args.admin_key or os.environ.get(ADMIN_KEY_ENV)
    try:
        if args.redis:
            windows, window_s = fetch_shared(args.redis, args.window)
            if window_s != args.window:
                print(
                    f"(the gateways share 1 min, 15 min and 1 h: {window_s:g} s)", file=sys.stderr
                )
        else:
            windows = fetch_windows(args.urls, key, args.window)
    except RuntimeError as err:
        print(f"cachelane report: {err}", file=sys.stderr)
        return 1
    merged = merge(windows)
    found = findings(merged)
    hints = pinned_pool_hints(args.urls, key) if args.urls else []
    if args.json:
        print(json.dumps(as_json(merged, found) | {"pinned_pool_hints": hints}, indent=2))
    else:
        out = Out()
        render(merged, found, out)
        for hint in hints:
            out.print(f"pinned pool: {hint}")
    if args.png is not None:
        try:
            draw(merged, args.png)
        except ImportError:
            print(
                f"cachelane report: --png needs matplotlib: {install_hint('sim')}",
                file=sys.stderr,
            )
            return 2
        print(f"wrote {args.png}", file=sys.stderr)
    return 0
