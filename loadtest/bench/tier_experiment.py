"""The tier benchmarks' arms: configs, one simulated fleet per section, one gateway per arm.

Pinning (critical tenant under a standard burst): the sim fleet hosts `replicas` offload replicas
(HBM + CPU tier) and `pinned` HBM-only ones. Arm `pinned` routes through pools `pinned` (the
HBM-only replicas, pinned to critical tenants, with an admission cap) and `offload` (the first
`replicas - pinned` offload replicas); arm `unpinned` through one pool `shared` of `replicas`
offload replicas, the voice tenant being a standard tenant like the others. Both arms use the same
number of replicas; the one the arm does not name sits idle.

Remote admission: `replicas` offload replicas share one remote tier; each arm is a gateway with the
pool's `remote_write` set to one mode, after every replica's prefix cache and the remote tier were
emptied. The sims' counters are cumulative, so an arm reports their growth during the arm.

Every gateway runs with its config's defaults except what is written here (capacities, costs,
tenants, pools); nothing is tuned to the benchmark.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.bench.processes import gateway_from_config, loopback_urls, sim_from_config
from loadtest.bench.replay import RequestResult, Summary, replay, summarize
from loadtest.sim.config import SIM_MODEL
from loadtest.workloads.traces import TraceRecord

HTTP_TIMEOUT_S = 5.0  # one scrape or reset on loopback

MODEL_70B = "sim-llama-70b"
COSTS_70B: dict[str, float] = {
    # Llama-3.1-70B, BF16: 80 layers * 8 KV heads * 128 head dim * 2 (K, V) * 2 bytes = 320 KiB
    # (meta-llama/Llama-3.1-70B config.json: num_hidden_layers=80, num_key_value_heads=8).
    "kv_bytes_per_token": 327_680,
    # ~13k prompt tokens/s for 70B on TP4 H200: the 8B rate of routing/cost.py (~30k/s) scaled by
    # the parameter ratio (8B / 70B x 4 GPUs = 0.46), an estimate, not a measurement.
    "prefill_tokens_per_s": 13_000.0,
    # TP4: each GPU swaps its quarter of the KV heads in over its own PCIe Gen5 x16 link, ~50 GB/s
    # measured each (routing/cost.py PCIE_GBPS), so 4 x 50 GB/s for the replica.
    "pcie_gbps": 200.0,
}
# The pinning benchmark uses a 70B model on TP4 so that a burst of long prompts saturates a
# 4-replica fleet at a request rate two shared CPU cores can drive (a 70B prefill is ~2.3x an 8B's).

KEYS = {
    "voice": "voice-bench-key-1-0123456789abcdef0123456789",
    "web": "web-bench-key-1-0123456789abcdef0123456789",
}


@dataclass(frozen=True, slots=True)
class PinningSetup:
    replicas: int = 4  # per arm
    pinned: int = 1  # of those, pinned HBM-only replicas in arm `pinned`
    hbm_capacity_tokens: int = 24_000
    # Per replica: holds ~4 of the 16 shared 4-7k documents of the standard tenant (88k tokens),
    # so the rest lives in the CPU tier (partly offloaded prefixes) or is recomputed.
    cpu_capacity_tokens: int = 200_000
    max_prefill_tokens: int = 8_000
    # Admission cap of a pinned replica: ~0.6 s of 70B prefill queued, which is what a new
    # request's TTFT waits behind. Above it, critical traffic takes the fallback (spill).
    max_in_flight: int = 16
    # Streams past their first token barely delay a new prefill; 16 only bounds the decode batch.
    # With 4, a Poisson cluster of 5 voice requests within 100 ms (12-token answers stream for
    # ~130 ms each) hit the cap, and the spilled request queued ~650 ms in the saturated pool.


@dataclass(frozen=True, slots=True)
class ReuseSetup:
    replicas: int = 4
    hbm_capacity_tokens: int = 12_000
    cpu_capacity_tokens: int = 8_000
    # 4 x (12k + 8k) = 80k tokens of HBM and CPU in the fleet, against ~110k tokens of the 24
    # shared 3-6k documents of the high-reuse workload plus every one-off prompt: prefixes are
    # evicted from both local tiers, and a later request finds them only in the remote tier.


@dataclass
class ArmResult:
    arm: str
    groups: dict[str, Summary]  # "critical", "standard" or "all"
    gateway: dict[str, float]  # counters from the gateway's /metrics
    sims: dict[str, float]  # the sims' counters, summed over replicas, grown during the arm
    off_pinned: int = 0  # critical requests served outside the pinned pool
    results: dict[str, list[RequestResult]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "groups": {g: s.to_dict() for g, s in self.groups.items()},
            "gateway": self.gateway,
            "sims": self.sims,
            "critical_off_pinned_pool": self.off_pinned,
        }


# --- metrics ---------------------------------------------------------------------------------

GATEWAY_COUNTERS = (
    "cachelane_critical_fallbacks",
    "cachelane_remote_admission",
    "cachelane_remote_bytes_admitted",
    "cachelane_remote_bytes_refused",
    "cachelane_shed",
)
SIM_COUNTERS = (
    "cachelane_sim_remote_bytes_written",
    "cachelane_sim_remote_bytes_skipped",
    "cachelane_sim_remote_fetch_tokens",
    "cachelane_sim_remote_recompute_tokens",
    "cachelane_sim_swap_in_tokens",
)


def scrape(urls: Sequence[str], names: Sequence[str]) -> dict[str, float]:
    """Counters named in `names`, summed over `urls`' /metrics; labelled ones as name{k=v}
    (labels other than model_name and engine, which every sim sets)."""
    out: dict[str, float] = {}
    with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
        for url in urls:
            text = client.get(f"{url}/metrics").text
            for family in text_string_to_metric_families(text):
                if family.name not in names:
                    continue
                for sample in family.samples:
                    if not sample.name.endswith("_total"):
                        continue
                    labels = {
                        k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")
                    }
                    key = family.name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels.items()))
                    out[key] = out.get(key, 0.0) + sample.value
    return out


def _grown(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _reset(replicas: Sequence[str], remote: str | None) -> None:
    with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
        for url in replicas:
            client.post(f"{url}/reset_prefix_cache").raise_for_status()
        if remote is not None:
            client.post(f"{remote}/reset").raise_for_status()


async def _timed(
    trace: list[TraceRecord], url: str, model: str, key: str
) -> tuple[list[RequestResult], float]:
    started = time.perf_counter()
    results = await replay(trace, url, model=model, api_key=key)
    return results, time.perf_counter() - started


def _tenants(voice_class: str) -> list[dict[str, str]]:
    return [
        {"name": "voice", "api_key": KEYS["voice"], "class": voice_class},
        {"name": "web", "api_key": KEYS["web"], "class": "standard"},
    ]


# --- pinning ---------------------------------------------------------------------------------


def _pool(
    name: str, urls: Sequence[str], model: str, hbm: int, cpu: int, **extra: Any
) -> dict[str, Any]:
    return {
        "name": name,
        "replicas": list(urls),
        "models": [model],
        "hbm_capacity_tokens": hbm,
        "cpu_capacity_tokens": cpu,
        **extra,
    }


@dataclass(frozen=True)
class PinningFleet:
    pinned: list[str]
    offload: list[str]

    def sim_config(self, s: PinningSetup) -> dict[str, Any]:
        costs = {"costs": COSTS_70B}
        return {
            "pools": [
                _pool("pinned", self.pinned, MODEL_70B, s.hbm_capacity_tokens, 0, **costs),
                _pool(
                    "offload",
                    self.offload,
                    MODEL_70B,
                    s.hbm_capacity_tokens,
                    s.cpu_capacity_tokens,
                    **costs,
                ),
            ]
        }

    def gateway_config(self, s: PinningSetup, arm: str) -> dict[str, Any]:
        hbm, cpu, costs = s.hbm_capacity_tokens, s.cpu_capacity_tokens, {"costs": COSTS_70B}
        if arm == "unpinned":
            pools = [_pool("shared", self.offload, MODEL_70B, hbm, cpu, **costs)]
            return {"tenants": _tenants("standard"), "pools": pools}
        admission = {"max_in_flight": s.max_in_flight, "max_prefill_tokens": s.max_prefill_tokens}
        shared = self.offload[: s.replicas - s.pinned]
        pools = [
            _pool(
                "pinned",
                self.pinned,
                MODEL_70B,
                hbm,
                0,
                pinned=True,
                hbm_only=True,
                admission=admission,
                **costs,
            ),
            _pool("offload", shared, MODEL_70B, hbm, cpu, **costs),
        ]
        return {"tenants": _tenants("critical"), "pools": pools}


def run_pinning(
    setup: PinningSetup,
    voice: list[TraceRecord],
    standard: list[TraceRecord],
    log_dir: Path,
    arms: Sequence[str] = ("unpinned", "pinned"),
) -> dict[str, ArmResult]:
    if not 0 < setup.pinned < setup.replicas:
        raise ValueError("pinning: need 0 < pinned < replicas")
    urls = loopback_urls(setup.replicas + setup.pinned)
    fleet = PinningFleet(urls[: setup.pinned], urls[setup.pinned :])
    out: dict[str, ArmResult] = {}
    with sim_from_config(fleet.sim_config(setup), log_dir, "pinning"):
        for arm in arms:
            _reset(urls, None)
            config = fleet.gateway_config(setup, arm)
            with gateway_from_config(config, log_dir, f"pinning-{arm}") as gw:
                (crit, crit_s), (std, std_s) = asyncio.run(
                    _both(gw.url, voice, standard, MODEL_70B)
                )
                metrics = scrape([gw.url], GATEWAY_COUNTERS)
            pinned_names = {u.removeprefix("http://") for u in fleet.pinned}
            off = sum(1 for r in crit if r.ok and r.replica not in pinned_names)
            out[arm] = ArmResult(
                arm,
                {"critical": summarize(crit, crit_s), "standard": summarize(std, std_s)},
                metrics,
                {},
                off_pinned=off if arm == "pinned" else 0,
                results={"critical": crit, "standard": std},
            )
    return out


async def _both(
    url: str, voice: list[TraceRecord], standard: list[TraceRecord], model: str
) -> tuple[tuple[list[RequestResult], float], tuple[list[RequestResult], float]]:
    crit, std = await asyncio.gather(
        _timed(voice, url, model, KEYS["voice"]), _timed(standard, url, model, KEYS["web"])
    )
    return crit, std


# --- remote admission ------------------------------------------------------------------------


@contextmanager
def reuse_fleet(setup: ReuseSetup, log_dir: Path, name: str) -> Iterator[tuple[list[str], str]]:
    """The sim fleet of the remote-admission arms: (replica URLs, remote tier URL)."""
    urls = loopback_urls(setup.replicas + 1)
    replicas, remote = urls[1:], urls[0]
    with sim_from_config(_reuse_config(setup, replicas, remote, "reuse"), log_dir, name):
        yield replicas, remote


def _reuse_config(setup: ReuseSetup, replicas: list[str], remote: str, mode: str) -> dict[str, Any]:
    pool = _pool(
        "offload",
        replicas,
        SIM_MODEL,
        setup.hbm_capacity_tokens,
        setup.cpu_capacity_tokens,
        remote_tier="kv",
        remote_write=mode,
    )
    return {
        "tenants": _tenants("standard"),
        "remote_tiers": [{"name": "kv", "url": remote}],
        "pools": [pool],
    }


def run_reuse_arm(
    setup: ReuseSetup,
    fleet: tuple[list[str], str],
    trace: list[TraceRecord],
    mode: str,
    log_dir: Path,
    name: str,
) -> ArmResult:
    replicas, remote = fleet
    _reset(replicas, remote)
    before = scrape(replicas, SIM_COUNTERS)
    with gateway_from_config(_reuse_config(setup, replicas, remote, mode), log_dir, name) as gw:
        results, replay_s = asyncio.run(_timed(trace, gw.url, SIM_MODEL, KEYS["web"]))
        metrics = scrape([gw.url], GATEWAY_COUNTERS)
    sims = _grown(scrape(replicas, SIM_COUNTERS), before)
    return ArmResult(
        mode, {"all": summarize(results, replay_s)}, metrics, sims, results={"all": results}
    )
