"""Findings: rules over the cost accounting saying, in plain words, where offloading's cost landed.

Pure (no IO): `cachelane report` (gateway/cli/report.py) merges the gateways' GET /debug/costs
windows with `merge()`, groups them with `by_class()` and `by_tenant()`, and prints `findings()`.
Each rule states its threshold as a named constant below; a rule that does not fire says nothing.

  remote_waste    bytes written to the remote tier and evicted without a read, >= 30% of the bytes
                  written (and who wrote them)
  pcie            a class's swap-in time >= 15% of its TTFT; how often swap-ins shared the link
  queue           a class's queue >= 50% of its TTFT: the cost is capacity, not offloading
  fetch_pays      remote fetches took longer than the prefill they avoided
  critical_load   a critical class spends >= 10% of its TTFT loading KV (swap-in + fetch)
  hbm_churn       a pool's HBM turned over at least once in the window (evicted >= capacity), and
                  whose prompts inserted most of the blocks
  avoided         always: the prefill GPU-seconds the hits avoided, by tier
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from routing.accounting import FIELDS

REMOTE_WASTE_SHARE = 0.30
# A third of the writes never read means the admission policy writes what does not come back
# (the tier benchmark's one-off prompts wrote 76-85 GB for no hit under `always`, docs/tiers.md).
MIN_REMOTE_WRITTEN_BYTES = 64 * 2**20  # below 64 MiB in a window the share is noise, not a cost
PCIE_SHARE = 0.15  # swap-in >= 15% of a class's TTFT: PCIe is a visible part of what users wait
QUEUE_SHARE = 0.50  # queue >= half of a class's TTFT: more replicas, not another tier, helps
CRITICAL_LOAD_SHARE = 0.10  # a critical class should not wait on KV loads: 10% is already felt
HBM_TURNOVERS = 1.0  # a pool that evicted its whole HBM capacity in the window keeps nothing warm
MIN_REQUESTS = 5  # a class with fewer answered requests in the window is not judged
TOP_SHARE = 0.5  # a tenant named as "most of" a cost holds at least half of it

Sums = dict[str, float]


@dataclass(frozen=True, slots=True)
class Finding:
    rule: str
    text: str


def merge(windows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Several gateways' /debug/costs windows of the same length as one: row sums added by
    (tenant, class, pool); pool evictions added (each gateway's index sees its own traffic), pool
    capacities taken once; the remote tiers' unread bytes added by writer."""
    rows: dict[tuple[str, str, str], Sums] = {}
    pools: dict[str, dict[str, Any]] = {}
    tiers: dict[str, dict[str, Any]] = {}
    window_s = 0.0
    for w in windows:
        window_s = max(window_s, float(w["window_s"]))
        for row in w["rows"]:
            key = (row["tenant"], row["tenant_class"], row["pool"])
            into = rows.setdefault(key, dict.fromkeys(FIELDS, 0.0))
            for name, value in row["sums"].items():
                if name in into:
                    into[name] += value
        for pool in w["pools"]:
            seen = pools.setdefault(pool["pool"], {**pool, "hbm_evicted_blocks": 0.0})
            seen["hbm_evicted_blocks"] += pool["hbm_evicted_blocks"]
        for tier in w["remote_tiers"]:
            t = tiers.setdefault(tier["name"], {**tier, "resident_unread_bytes": {}})
            for entry in tier["resident_unread_bytes"]:
                writer = (entry["tenant"], entry["tenant_class"], entry["pool"])
                t["resident_unread_bytes"][writer] = (
                    t["resident_unread_bytes"].get(writer, 0.0) + entry["bytes"]
                )
    return {"window_s": window_s, "rows": rows, "pools": pools, "remote_tiers": tiers}


def _add(into: Sums, sums: Mapping[str, float]) -> None:
    for name, value in sums.items():
        into[name] = into.get(name, 0.0) + value


def by_class(rows: Mapping[tuple[str, str, str], Sums]) -> dict[str, Sums]:
    out: dict[str, Sums] = {}
    for (_, klass, _), sums in rows.items():
        _add(out.setdefault(klass, {}), sums)
    return out


def by_tenant(rows: Mapping[tuple[str, str, str], Sums]) -> dict[tuple[str, str], Sums]:
    out: dict[tuple[str, str], Sums] = {}
    for (tenant, klass, _), sums in rows.items():
        _add(out.setdefault((tenant, klass), {}), sums)
    return out


def total(rows: Mapping[Any, Sums]) -> Sums:
    out: Sums = {}
    for sums in rows.values():
        _add(out, sums)
    return out


def share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def _top(by: Mapping[tuple[str, str], Sums], name: str) -> tuple[str, float] | None:
    """The tenant with the largest `name`, and its share of the total."""
    whole = sum(s.get(name, 0.0) for s in by.values())
    if whole <= 0:
        return None
    (tenant, _), sums = max(by.items(), key=lambda kv: kv[1].get(name, 0.0))
    return tenant, sums.get(name, 0.0) / whole


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def findings(merged: Mapping[str, Any]) -> list[Finding]:
    """The rules of the module docstring over a merged window, in that order."""
    rows = merged["rows"]
    classes, tenants, all_ = by_class(rows), by_tenant(rows), total(rows)
    window = _window_words(merged["window_s"])
    out: list[Finding] = []
    out += _remote_waste(all_, tenants, merged, window)
    for klass, sums in sorted(classes.items()):
        if sums.get("requests", 0) < MIN_REQUESTS:
            continue
        out += _per_class(klass, sums)
    out += _fetch_pays(all_)
    out += _hbm_churn(merged, window)
    out.append(_avoided(all_, window))
    return out


def _remote_waste(
    all_: Sums, tenants: Mapping[tuple[str, str], Sums], merged: Mapping[str, Any], window: str
) -> list[Finding]:
    written = all_.get("remote_written_bytes", 0.0)
    never = all_.get("remote_never_read_bytes", 0.0)
    if written < MIN_REMOTE_WRITTEN_BYTES or share(never, written) < REMOTE_WASTE_SHARE:
        return []
    unread_now = sum(
        v for t in merged["remote_tiers"].values() for v in t["resident_unread_bytes"].values()
    )
    text = (
        f"remote tier: {pct(share(never, written))} of the bytes written in {window} "
        f"({gib(never)} of {gib(written)}) were evicted without ever being read"
    )
    top = _top(tenants, "remote_never_read_bytes")
    if top is not None and top[1] >= TOP_SHARE:
        tenant, part = top
        row = next(s for (t, _), s in tenants.items() if t == tenant)
        hit = share(row.get("remote_tokens", 0.0), row.get("prompt_tokens", 0.0))
        text += (
            f"; tenant {tenant}'s prompts are {pct(part)} of them (its remote hit rate: {pct(hit)})"
        )
    if unread_now:
        text += f"; {gib(unread_now)} more sit in the tier unread"
    text += ". Reuse-aware admission (pools[].remote_write: reuse) writes only prefixes seen again."
    return [Finding("remote_waste", text)]


def _per_class(klass: str, s: Sums) -> list[Finding]:
    out: list[Finding] = []
    ttft = s.get("observed_ttft_s", 0.0)
    timed = s.get("timed_requests", 0.0)
    if ttft <= 0 or timed <= 0:
        return out
    swap, queue = share(s.get("swap_s", 0.0), ttft), share(s.get("queue_s", 0.0), ttft)
    load = share(s.get("swap_s", 0.0) + s.get("fetch_s", 0.0), ttft)
    mean_ms = 1000 * ttft / timed
    if swap >= PCIE_SHARE:
        swaps = s.get("swap_ins", 0.0)
        shared = share(s.get("shared_swap_ins", 0.0), swaps)
        at_once = share(s.get("swap_link_sharers", 0.0), swaps)
        text = (
            f"class {klass}: swap-ins over PCIe are {pct(swap)} of its TTFT (mean TTFT "
            f"{mean_ms:.0f} ms); "
        )
        if shared > 0:
            text += (
                f"{pct(shared)} of its {swaps:.0f} swap-ins shared the link ({at_once:.1f} at "
                "once on average): the link is contended"
            )
        else:
            text += f"none of its {swaps:.0f} swap-ins shared the link: the link itself is slow"
        out.append(Finding("pcie", text))
    if queue >= QUEUE_SHARE:
        out.append(
            Finding(
                "queue",
                f"class {klass}: {pct(queue)} of its TTFT (mean {mean_ms:.0f} ms) is waiting for "
                "the prefill: the cost here is capacity, not offloading (more replicas, or "
                "shedding batch traffic, shortens it; another tier does not)",
            )
        )
    if klass == "critical" and load >= CRITICAL_LOAD_SHARE:
        out.append(
            Finding(
                "critical_load",
                f"class critical: {pct(load)} of its TTFT is loading KV from the CPU or remote "
                "tier; an HBM-only pinned pool (pools[].hbm_only, pinned) keeps its prefixes "
                "resident and its latency predictable",
            )
        )
    return out


def _fetch_pays(all_: Sums) -> list[Finding]:
    fetch_s, avoided_s = all_.get("fetch_s", 0.0), all_.get("avoided_remote_s", 0.0)
    if fetch_s <= 0 or fetch_s <= avoided_s:
        return []
    return [
        Finding(
            "fetch_pays",
            f"remote fetches took {fetch_s:.2f} s for {avoided_s:.2f} GPU-s of prefill they "
            "avoided: at these prefix lengths recomputing is faster than the network (check "
            "the remote tier's bandwidth and the pool's remote_gbps / remote_fixed_s)",
        )
    ]


def _hbm_churn(merged: Mapping[str, Any], window: str) -> list[Finding]:
    out = []
    for name, pool in sorted(merged["pools"].items()):
        capacity = pool.get("hbm_capacity_blocks", 0)
        evicted = pool.get("hbm_evicted_blocks", 0.0)
        turnovers = share(evicted, capacity)
        if capacity <= 0 or turnovers < HBM_TURNOVERS:
            continue
        text = (
            f"pool {name}: its HBM turned over {turnovers:.1f}x in {window} ({evicted:,.0f} "
            f"blocks evicted, {capacity:,} held)"
        )
        in_pool: dict[tuple[str, str], Sums] = {}
        for (tenant, klass, pool_name), sums in merged["rows"].items():
            if pool_name == name:
                _add(in_pool.setdefault((tenant, klass), {}), sums)
        top = _top(in_pool, "hbm_inserted_blocks")
        if top is not None:
            text += f"; tenant {top[0]}'s prompts inserted {pct(top[1])} of the blocks"
        out.append(Finding("hbm_churn", text))
    return out


def _avoided(all_: Sums, window: str) -> Finding:
    parts = [all_.get(f"avoided_{t}_s", 0.0) for t in ("hbm", "cpu", "remote")]
    spent = all_.get("swap_s", 0.0) + all_.get("fetch_s", 0.0)
    return Finding(
        "avoided",
        f"cache hits avoided {sum(parts):.2f} GPU-s of prefill in {window}: HBM {parts[0]:.2f}, "
        f"CPU tier {parts[1]:.2f}, remote tier {parts[2]:.2f} (loading the CPU and remote hits "
        f"took {spent:.2f} s of TTFT)",
    )


def _window_words(window_s: float) -> str:
    if window_s >= 3600 and window_s % 3600 == 0:
        return f"{window_s / 3600:g} h"
    if window_s >= 60 and window_s % 60 == 0:
        return f"{window_s / 60:g} min"
    return f"{window_s:g} s"


def class_order(classes: Sequence[str]) -> list[str]:
    rank = {"critical": 0, "standard": 1, "batch": 2}
    return sorted(classes, key=lambda c: (rank.get(c, 9), c))
