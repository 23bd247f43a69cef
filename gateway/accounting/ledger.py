"""Cost accounting at the edge: feed routing/accounting.py from the proxy and the index, export it.

    proxy, a replica took the request   CostAccounting.sent(plan, replica)
                                         remote ledger: the remote-held run read (touched), the
                                         prompt written when admission said so
    proxy, the answer ended              CostAccounting.answered(plan, replica, ttft, usage)
                                         tokens by tier, PCIe bytes, GPU-seconds avoided, the TTFT
                                         attributed to layers (streamed requests)
    index, entries left a location       CostAccounting.index_removed(location, blocks, cause)
                                         HBM churn per pool

    GET /debug/costs[?window_s=60]       admin key; JSON per window (WINDOWS_S): rows per
                                         (tenant, class, pool) with every routing.accounting
                                         FIELDS sum, pool rows, the remote ledgers' state

What the gateway knows and what it estimates: tokens by tier are the decision's overlap
corrected by the engine's reported cached tokens; the remote tier's contents are the gateway's
own model of it (routing.accounting.RemoteLedger: an LRU at the configured capacity, fed by this
gateway's writes and reads); HBM evictions are the index's (approximate mode: its per-replica LRU
at the HBM capacity; precise mode: the engines' BlockRemoved events).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from fastapi import APIRouter, Request

from gateway.config import GatewayConfig, PoolConfig
from gateway.fleet.registry import Registry
from gateway.fleet.replica import Replica
from gateway.http.errors import bad_request
from gateway.serving.plan import Plan
from gateway.telemetry.metrics import Metrics
from gateway.tenancy.admin_auth import require_admin_or_open
from routing.accounting import (
    BUCKET_S,
    FIELDS,
    LAYERS,
    WINDOWS_S,
    CostKey,
    RemoteLedger,
    Windows,
    request_fields,
)
from routing.cost import CostTerms
from routing.types import Location, Tier

ALL = "*"  # tenant and class of pool-level rows (an eviction has no tenant)
_CHURN_CAUSES = ("capacity", "evicted")  # not TTL expiry, not a replica dropped


class CostAccounting:
    def __init__(
        self,
        config: GatewayConfig,
        registry: Registry,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._block = config.routing.block_size_tokens
        self._pool_configs = config.pools
        self._registry = registry
        self._metrics = metrics
        self._clock = clock
        self._rows = Windows()
        self._pools = Windows()
        # --workers N with a view every worker shares: only one counts evictions (gateway/wiring.py)
        self.counts_evictions: Callable[[], bool] = lambda: True
        self._series: dict[CostKey, _RequestSeries] = {}  # bounded: keys are (Windows.key_of)
        self._ledgers: dict[str, RemoteLedger] = {}
        for tier in config.remote_tiers:
            users = [r for r in registry.replicas.values() if r.pool.remote_tier == tier.name]
            if users:
                block_bytes = self._block * users[0].costs.kv_bytes_per_token
                self._ledgers[tier.name] = RemoteLedger(
                    tier.capacity_tokens // self._block, block_bytes
                )

    def set_pools(self, pools: list[PoolConfig]) -> None:
        """The pools a reload left (gateway/fleet/reload.py): the report lists these."""
        self._pool_configs = pools

    def key(self, plan: Plan, replica: Replica) -> CostKey:
        tenant = plan.tenant
        return self._rows.key_of(CostKey(tenant.name, tenant.tenant_class.value, replica.pool.name))

    def sent(self, plan: Plan, replica: Replica) -> None:
        """A replica accepted the request: the remote ledger sees its read, then its write."""
        tier = replica.pool.remote_tier
        ledger = self._ledgers.get(tier) if tier and not replica.pool.hbm_only else None
        if ledger is None or plan.endpoint == "embeddings":
            return
        score = plan.decision.score(replica.name)
        o, bs = score.overlap, self._block
        start = (o.hbm_tokens + o.cpu_tokens) // bs
        run = plan.hashes[start : start + o.remote_tokens // bs]
        if run:
            ledger.read(run, fetched=score.estimate.remote_fetch)
        if plan.admission is None or not plan.admission.write:
            return
        written, lost = ledger.write(plan.hashes, self.key(plan, replica))
        self._add(self.key(plan, replica), {"remote_written_bytes": written})
        for writer, eviction in lost.items():
            self._add(
                writer,
                {
                    "remote_evicted_bytes": eviction.evicted_bytes,
                    "remote_never_read_bytes": eviction.never_read_bytes,
                },
            )

    def answered(
        self,
        plan: Plan,
        replica: Replica,
        observed_s: float | None,
        cached_tokens: int | None,
        prompt_tokens: int | None,
    ) -> None:
        """An answer (status < 400) ended; `observed_s` is a streamed request's TTFT (None for a
        whole answer: its first byte came after the decode), the rest the engine's usage."""
        if plan.endpoint == "embeddings":
            return
        score = plan.decision.score(replica.name)
        fields = request_fields(
            score.overlap,
            score.estimate,
            replica.terms or CostTerms.seed(replica.costs),
            replica.costs,
            block_size_tokens=self._block,
            observed_s=observed_s,
            cached_tokens=cached_tokens,
            prompt_tokens=prompt_tokens,
        )
        self._add(self.key(plan, replica), fields)

    def index_removed(self, location: Location, blocks: int, cause: str) -> None:
        """The index's hook (routing.index.MemoryIndex on_removed): HBM churn per pool."""
        if location.tier is not Tier.HBM or cause not in _CHURN_CAUSES:
            return
        if not self.counts_evictions():
            return
        replica = self._registry.replicas.get(location.holder)
        if replica is None:
            return
        self._add(CostKey(ALL, ALL, replica.pool.name), {"hbm_evicted_blocks": blocks})

    def _add(self, key: CostKey, fields: Mapping[str, float]) -> None:
        if key.tenant == ALL:
            self._pools.add(self._clock(), key, fields)
        else:
            self._rows.add(self._clock(), key, fields)
        self._export(key, fields)

    def _export(self, key: CostKey, f: Mapping[str, float]) -> None:
        m, labels = self._metrics, (key.tenant, key.tenant_class, key.pool)
        if f.get("timed_requests") or f.get("requests"):
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = _RequestSeries(m, labels)
            if f.get("timed_requests"):
                series.add(series.timed, f)
            if f.get("requests"):
                series.add(series.answered, f)
        if f.get("swap_ins"):
            m.cost_pcie_bytes.labels(*labels).inc(f["pcie_bytes"])
            shared = "yes" if f["shared_swap_ins"] else "no"
            m.cost_swap_ins.labels(*labels, shared).inc()
        for kind in ("written", "read", "evicted", "never_read"):
            value = f.get(f"remote_{kind}_bytes")
            if value:
                m.cost_remote_bytes.labels(*labels, kind).inc(value)
        if f.get("hbm_evicted_blocks"):
            m.cost_hbm_blocks.labels(*labels, "evicted").inc(f["hbm_evicted_blocks"])

    def snapshot(self, window_s: float) -> dict[str, Any]:
        """One window's sums, JSON-ready; several gateways' snapshots merge by adding sums."""
        now = self._clock()
        self._rows.forget_idle_keys(now)
        rows = [_row(k, sums) for k, sums in sorted(self._rows.totals(now, window_s).items())]
        pool_sums = self._pools.totals(now, window_s)
        pools = []
        for pool in self._pool_configs:
            replicas = [r for r in self._registry.replicas.values() if r.pool.name == pool.name]
            sums = pool_sums.get(CostKey(ALL, ALL, pool.name), dict.fromkeys(FIELDS, 0.0))
            pools.append(
                {
                    "pool": pool.name,
                    "replicas": len(replicas),
                    "hbm_capacity_blocks": sum(
                        r.hbm_capacity_tokens() // self._block for r in replicas
                    ),
                    "cpu_tier": bool(pool.cpu_capacity_tokens),
                    "remote_tier": pool.remote_tier,
                    "hbm_only": pool.hbm_only,
                    "hbm_evicted_blocks": sums["hbm_evicted_blocks"],
                }
            )
        tiers = []
        for name, ledger in self._ledgers.items():
            unread = sorted(ledger.resident_unread().items())
            tiers.append(
                {
                    "name": name,
                    "capacity_blocks": ledger.capacity * ledger.rate,
                    "block_bytes": ledger.block_bytes,
                    "sample_rate": ledger.rate,
                    "tracked_blocks": len(ledger),
                    "resident_unread_bytes": [{**_labels(k), "bytes": v} for k, v in unread if v],
                }
            )
        return {
            "window_s": window_s,
            "bucket_s": BUCKET_S,
            "rows": rows,
            "pools": pools,
            "remote_tiers": tiers,
        }


class _RequestSeries:
    """The counter children one (tenant, class, pool) key's answers add to, resolved once: an
    answer adds to ~13 of them, and a field that is zero (a tier the prompt did not touch) is not
    added (its series exists from the first answer on, at zero, as before)."""

    __slots__ = ("answered", "timed")

    def __init__(self, m: Metrics, labels: tuple[str, str, str]) -> None:
        self.timed = [
            (f"{layer}_s", m.cost_ttft_seconds.labels(*labels, layer)) for layer in LAYERS
        ]
        tokens = [(f"{t}_tokens", m.cost_tokens.labels(*labels, t)) for t in _TOKEN_TIERS]
        avoided = [
            (f"avoided_{t}_s", m.cost_prefill_avoided_seconds.labels(*labels, t))
            for t in _TOKEN_TIERS[:-1]
        ]
        inserted = ("hbm_inserted_blocks", m.cost_hbm_blocks.labels(*labels, "inserted"))
        self.answered = [*tokens, *avoided, inserted]

    @staticmethod
    def add(children: list[tuple[str, Any]], f: Mapping[str, float]) -> None:
        for field, child in children:
            value = f[field]
            if value:
                child.inc(value)


_TOKEN_TIERS = ("hbm", "cpu", "remote", "computed")


def _labels(key: CostKey) -> dict[str, str]:
    return {"tenant": key.tenant, "tenant_class": key.tenant_class, "pool": key.pool}


def _row(key: Hashable, sums: Mapping[str, float]) -> dict[str, Any]:
    assert isinstance(key, CostKey)
    return {**_labels(key), "sums": {k: round(v, 9) for k, v in sums.items()}}


costs_router = APIRouter()


@costs_router.get("/debug/costs")
async def debug_costs(request: Request) -> dict[str, Any]:
    """The cost accounting per window (admin key, like /admin; open in auth.mode open):
    ?window_s=N for one window."""
    gw = require_admin_or_open(request)
    raw = request.query_params.get("window_s")
    windows: tuple[float, ...] = WINDOWS_S
    if raw is not None:
        try:
            window = float(raw)
        except ValueError:
            window = -1.0
        if not 0 < window <= max(WINDOWS_S):
            raise bad_request(
                f"window_s must be a number of seconds in (0, {max(WINDOWS_S):g}]",
                param="window_s",
            )
        windows = (window,)
    costs: CostAccounting = gw.costs
    workers = gw.worker_costs
    if workers is None:
        return {"fields": list(FIELDS), "windows": [costs.snapshot(w) for w in windows]}
    # --workers N: this worker's and its siblings' (they share the windows of WINDOWS_S)
    shared = [min(s for s in WINDOWS_S if s >= w) for w in windows]
    return {
        "fields": list(FIELDS),
        "windows": [
            merge_snapshots([costs.snapshot(w), *workers.siblings_windows(w)]) for w in shared
        ],
    }


def merge_snapshots(snapshots: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several snapshots of one window as one: row sums and pool evictions added (each process
    counts its own requests, and an eviction once), pools' capacities taken once, remote tiers'
    unread bytes added by writer."""
    rows: dict[tuple[str, str, str], dict[str, float]] = {}
    pools: dict[str, dict[str, Any]] = {}
    tiers: dict[str, dict[str, Any]] = {}
    for snap in snapshots:
        for row in snap["rows"]:
            into = rows.setdefault(
                (row["tenant"], row["tenant_class"], row["pool"]), dict.fromkeys(FIELDS, 0.0)
            )
            for name, value in row["sums"].items():
                into[name] = into.get(name, 0.0) + value
        for pool in snap["pools"]:
            seen = pools.setdefault(pool["pool"], {**pool, "hbm_evicted_blocks": 0.0})
            seen["hbm_evicted_blocks"] += pool["hbm_evicted_blocks"]
        for tier in snap["remote_tiers"]:
            t = tiers.setdefault(tier["name"], {**tier, "tracked_blocks": 0, "unread": {}})
            t["tracked_blocks"] += tier["tracked_blocks"]
            for e in tier["resident_unread_bytes"]:
                writer = CostKey(e["tenant"], e["tenant_class"], e["pool"])
                t["unread"][writer] = t["unread"].get(writer, 0.0) + e["bytes"]
    return {
        "window_s": snapshots[0]["window_s"],
        "bucket_s": snapshots[0]["bucket_s"],
        "processes": len(snapshots),
        "rows": [_row(CostKey(*k), sums) for k, sums in sorted(rows.items())],
        "pools": list(pools.values()),
        "remote_tiers": [
            {
                **{k: v for k, v in t.items() if k not in ("unread", "resident_unread_bytes")},
                "resident_unread_bytes": [
                    {**_labels(k), "bytes": v} for k, v in sorted(t["unread"].items())
                ],
            }
            for t in tiers.values()
        ],
    }
