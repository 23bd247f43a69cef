"""The traffic capture's format: what the gateway writes (gateway/accounting/capture.py), what the
planner reads. Pure: records are built from values and parsed from decoded JSON, never from a file.

A capture is JSON lines. The first is the header (the set-up the traffic was served on); then one
line per answered request, in the order the answers ended; and, every so often and at the end,
the cost terms the gateway had fitted (routing/learn.py). No prompt text is ever written: a
request is its block hashes (the chained 64-bit hashes the router keys its index by,
routing/hashing.py, as 16 hex digits) and its token counts.

  {"type": "header", "version": 1, "block_size_tokens": 16, "mode": "approximate",
   "policy": "cache_aware", "index_ttl_s": 600, "pools": [...], "remote_tiers": [...]}
  {"type": "request", "t_s": 12.345, "tenant": "web", "class": "standard", "model": "m",
   "endpoint": "chat", "stream": true, "pool": "offload", "replica": "10.0.0.7:8000",
   "reason": "hbm_hit", "prompt_tokens": 5120, "hashes": ["9f0c...", ...], "max_tokens": 64,
   "est_ttft_s": 0.081, "expected": {"hbm": 4096, "cpu": 0, "remote": 0},
   "remote_fetch": false, "remote_write": null, "status": 200, "ttft_s": 0.092, "e2e_s": 0.71,
   "engine_prompt_tokens": 5123, "cached_tokens": 4096,
   "hit": {"hbm": 4096, "cpu": 0, "remote": 0, "computed": 1027}}
  {"type": "fit", "t_s": 60.0, "replicas": {"10.0.0.7:8000": {"pool": "offload",
   "fixed_s": 0.004, "prefill_s_per_token": 3.4e-05, "swap_s_per_token": 2.6e-06,
   "fetch_s_per_token": 5.4e-06, "samples": 180}}}

`t_s` is when the gateway sent the request, in seconds from the capture's start. `ttft_s` is null
for a whole (non-streamed) answer, whose first byte comes after its decode. `hit` is where the
prompt's KV came from: the decision's expected split, corrected by the engine's own
`cached_tokens` when the answer carried usage (a shortfall is taken from the remote, then the
CPU, then the HBM share; a surplus counts as HBM).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from routing.cost import CostTerms, PoolCosts
from routing.pipeline import BATCH_MAX_QUEUE_S

VERSION = 1


class CaptureError(ValueError):
    """A capture line that is not what this version writes."""


def hex_hashes(hashes: Sequence[int]) -> list[str]:
    return [format(h, "016x") for h in hashes]


@dataclass(frozen=True, slots=True)
class HitTiers:
    hbm: int
    cpu: int
    remote: int
    computed: int

    def as_dict(self) -> dict[str, int]:
        return {"hbm": self.hbm, "cpu": self.cpu, "remote": self.remote, "computed": self.computed}


def hit_tiers(
    prompt_tokens: int, hbm: int, cpu: int, remote: int, cached_tokens: int | None
) -> HitTiers:
    """Where a prompt's KV came from: the expected split (`remote` only if fetched), corrected
    by what the engine reported reusing."""
    if cached_tokens is not None:
        missing = hbm + cpu + remote - cached_tokens
        if missing > 0:
            for_remote = min(missing, remote)
            for_cpu = min(missing - for_remote, cpu)
            remote -= for_remote
            cpu -= for_cpu
            hbm -= min(missing - for_remote - for_cpu, hbm)
        elif missing < 0:
            hbm -= missing
    cached = min(prompt_tokens, hbm + cpu + remote)
    return HitTiers(hbm, cpu, remote, max(0, prompt_tokens - cached))


@dataclass(frozen=True, slots=True)
class PoolSetup:
    """A pool as the capture's header (or a scenario) describes it."""

    name: str
    replicas: int
    hbm_capacity_tokens: int
    cpu_capacity_tokens: int = 0
    remote_tier: str | None = None
    remote_write: str = "reuse"  # reuse, always, never
    pinned: bool = False
    hbm_only: bool = False
    max_in_flight: int | None = None
    max_prefill_tokens: int | None = None
    lend_below: float | None = None
    costs: PoolCosts = field(default_factory=PoolCosts)
    engine_priority: bool = False  # gateway/config/pools.py PoolConfig: engines schedule first come
    replica_names: tuple[str, ...] = ()  # as captured; a scenario's own are synthetic


@dataclass(frozen=True, slots=True)
class Header:
    block_size_tokens: int
    mode: str
    policy: str
    index_ttl_s: float
    reuse_window_s: float
    pools: tuple[PoolSetup, ...]
    remote_tiers: dict[str, int]  # name -> capacity in tokens
    critical_fallback: str = "spill"
    critical_budget_ms: float | None = None
    # gateway/config/classes.py CriticalConfig and OverloadConfig defaults (a capture written before
    # the header carried them was served with those)
    critical_placement: str = "pinned_first"
    clear_while_loading: bool = False
    batch_max_queue_s: float = BATCH_MAX_QUEUE_S
    class_slo_ms: Mapping[str, float] = field(default_factory=dict)  # classes.*.ttft_slo_ms


@dataclass(frozen=True, slots=True)
class CapturedRequest:
    t_s: float
    tenant: str
    tenant_class: str
    model: str
    pool: str
    replica: str
    prompt_tokens: int  # the engine's count when it reported one, else the gateway's
    hashes: tuple[int, ...]
    stream: bool
    ttft_s: float | None
    e2e_s: float | None
    cached_tokens: int | None
    hit: HitTiers
    est_ttft_s: float
    ttft_slo_ms: float | None = None  # its objective (x-slo-ttft-ms or its class's)


@dataclass(frozen=True, slots=True)
class Capture:
    header: Header
    requests: tuple[CapturedRequest, ...]
    fit: dict[str, CostTerms]  # replica -> fitted terms (the last fit line); empty: none
    fit_pools: dict[str, str]  # replica -> its pool, for the fit's replicas

    def pool_terms(self) -> dict[str, CostTerms]:
        """Per pool, the fitted terms of its replicas with the most samples (the pool's best
        estimate; a scenario's replicas are new names, so the fit goes by pool)."""
        best: dict[str, CostTerms] = {}
        for replica, terms in self.fit.items():
            pool = self.fit_pools.get(replica)
            if pool is None:
                continue
            if pool not in best or terms.samples > best[pool].samples:
                best[pool] = terms
        return best


def parse_capture(objects: Iterable[Mapping[str, Any]]) -> Capture:
    """A capture from its decoded JSON lines, in order. Raises CaptureError."""
    header: Header | None = None
    requests: list[CapturedRequest] = []
    fit: dict[str, CostTerms] = {}
    fit_pools: dict[str, str] = {}
    for n, obj in enumerate(objects, 1):
        kind = obj.get("type")
        try:
            if kind == "header":
                if header is not None:
                    raise CaptureError("a second header")
                header = _header(obj)
            elif kind == "request":
                requests.append(_request(obj))
            elif kind == "fit":
                fit, fit_pools = _fit(obj)
            else:
                raise CaptureError(f"unknown type {kind!r}")
        except (KeyError, TypeError, ValueError) as err:
            raise CaptureError(f"line {n}: {err}") from None
    if header is None:
        raise CaptureError("no header line: not a cachelane capture")
    requests.sort(key=lambda r: r.t_s)
    return Capture(header, tuple(requests), fit, fit_pools)


def _header(obj: Mapping[str, Any]) -> Header:
    """Keys it does not read are ignored: a pool's `lend_keep_idle` and `lend_max_prefill_tokens`
    in a capture written before their removal (docs/critical.md, "A pinned pool")."""
    if obj.get("version") != VERSION:
        raise CaptureError(f"version {obj.get('version')!r}; this planner reads {VERSION}")
    pools = []
    for p in obj["pools"]:
        admission = p.get("admission") or {}
        pools.append(
            PoolSetup(
                name=str(p["name"]),
                replicas=len(p["replicas"]),
                replica_names=tuple(str(r) for r in p["replicas"]),
                hbm_capacity_tokens=int(p["hbm_capacity_tokens"]),
                cpu_capacity_tokens=int(p.get("cpu_capacity_tokens", 0)),
                remote_tier=p.get("remote_tier"),
                remote_write=str(p.get("remote_write", "reuse")),
                pinned=bool(p.get("pinned", False)),
                hbm_only=bool(p.get("hbm_only", False)),
                max_in_flight=admission.get("max_in_flight"),
                max_prefill_tokens=admission.get("max_prefill_tokens"),
                lend_below=p.get("lend_below"),
                costs=PoolCosts(**p["costs"]),
                engine_priority=bool(p.get("engine_priority", False)),
            )
        )
    return Header(
        block_size_tokens=int(obj["block_size_tokens"]),
        mode=str(obj["mode"]),
        policy=str(obj["policy"]),
        index_ttl_s=float(obj["index_ttl_s"]),
        reuse_window_s=float(obj["reuse_window_s"]),
        pools=tuple(pools),
        remote_tiers={str(k): int(v) for k, v in obj.get("remote_tiers", {}).items()},
        critical_fallback=str(obj.get("critical_fallback", "spill")),
        critical_budget_ms=obj.get("critical_budget_ms"),
        critical_placement=str(obj.get("critical_placement", "pinned_first")),
        clear_while_loading=bool(obj.get("clear_while_loading", False)),
        batch_max_queue_s=float(obj.get("batch_max_queue_s", BATCH_MAX_QUEUE_S)),
        class_slo_ms={str(k): float(v) for k, v in obj.get("class_slo_ms", {}).items()},
    )


def _request(obj: Mapping[str, Any]) -> CapturedRequest:
    hit = obj["hit"]
    engine_tokens = obj.get("engine_prompt_tokens")
    prompt = int(engine_tokens if engine_tokens is not None else obj["prompt_tokens"])
    return CapturedRequest(
        t_s=float(obj["t_s"]),
        tenant=str(obj["tenant"]),
        tenant_class=str(obj["class"]),
        model=str(obj["model"]),
        pool=str(obj["pool"]),
        replica=str(obj["replica"]),
        prompt_tokens=prompt,
        hashes=tuple(int(h, 16) for h in obj["hashes"]),
        stream=bool(obj["stream"]),
        ttft_s=_opt_float(obj.get("ttft_s")),
        e2e_s=_opt_float(obj.get("e2e_s")),
        cached_tokens=obj.get("cached_tokens"),
        hit=HitTiers(int(hit["hbm"]), int(hit["cpu"]), int(hit["remote"]), int(hit["computed"])),
        est_ttft_s=float(obj["est_ttft_s"]),
        ttft_slo_ms=_opt_float(obj.get("ttft_slo_ms")),
    )


def _fit(obj: Mapping[str, Any]) -> tuple[dict[str, CostTerms], dict[str, str]]:
    terms: dict[str, CostTerms] = {}
    pools: dict[str, str] = {}
    for name, t in obj["replicas"].items():
        terms[str(name)] = CostTerms(
            float(t["fixed_s"]),
            float(t["prefill_s_per_token"]),
            float(t["swap_s_per_token"]),
            float(t["fetch_s_per_token"]),
            samples=int(t.get("samples", 0)),
        )
        pools[str(name)] = str(t["pool"])
    return terms, pools


def _opt_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


def terms_record(terms: CostTerms, pool: str) -> dict[str, Any]:
    return {
        "pool": pool,
        "fixed_s": terms.fixed_s,
        "prefill_s_per_token": terms.prefill_s_per_token,
        "swap_s_per_token": terms.swap_s_per_token,
        "fetch_s_per_token": terms.fetch_s_per_token,
        "samples": terms.samples,
    }
