"""A fleet set-up the planner can replay a capture on, and the scenarios derived from one.

`Setup.from_capture` is the fleet the capture was served on (its header) with the cost terms the
gateway had fitted (the capture's last fit line), else the configured constants. A scenario is a
named change of it (`scenarios`): drop or add an offload tier, change the remote tier's
admission, carve a pinned HBM-only pool out of the fleet for critical tenants, scale HBM.
Pure: no IO.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from routing.cost import CostTerms
from routing.decide import Policy
from routing.filters import Fallback
from routing.pipeline import BATCH_MAX_QUEUE_S, PipelineSettings
from routing.types import TenantClass
from routing.whatif.capture import Capture, PoolSetup

DEFAULT_REMOTE_TIER = "remote"
PINNED_POOL = "pinned"


@dataclass(frozen=True, slots=True)
class Setup:
    name: str
    pools: tuple[PoolSetup, ...]
    remote_tiers: Mapping[str, int]  # name -> capacity in tokens
    block_size_tokens: int
    policy: str
    mode: str  # approximate: the router sees its own index; precise: the engines' caches
    index_ttl_s: float
    reuse_window_s: float
    terms: Mapping[str, CostTerms]  # pool -> cost terms (fitted, else the seed of its costs)
    critical_fallback: str = "spill"
    critical_budget_ms: float | None = None
    critical_tenants: frozenset[str] = field(default_factory=frozenset)  # served as critical
    critical_placement: str = "pinned_first"  # pinned_first or cost (gateway critical.placement)
    clear_while_loading: bool = False  # gateway critical.clear_while_loading
    batch_max_queue_s: float = BATCH_MAX_QUEUE_S  # gateway overload.batch_max_queue_s
    class_slo_ms: Mapping[str, float] = field(default_factory=dict)  # classes.*.ttft_slo_ms
    # A request that misses locally asks the remote tier what it holds before loading anything:
    # one round trip, which the cost model has no term for (a fit over a capture with a remote
    # tier has it in its fixed overhead). 0 unless a scenario states it.
    remote_lookup_s: float = 0.0

    @classmethod
    def from_capture(cls, capture: Capture, name: str = "as captured") -> Setup:
        h = capture.header
        fitted = capture.pool_terms()
        terms = {p.name: fitted.get(p.name, CostTerms.seed(p.costs)) for p in h.pools}
        return cls(
            name=name,
            pools=h.pools,
            remote_tiers=dict(h.remote_tiers),
            block_size_tokens=h.block_size_tokens,
            policy=h.policy,
            mode=h.mode,
            index_ttl_s=h.index_ttl_s,
            reuse_window_s=h.reuse_window_s,
            terms=terms,
            critical_fallback=h.critical_fallback,
            critical_budget_ms=h.critical_budget_ms,
            critical_placement=h.critical_placement,
            clear_while_loading=h.clear_while_loading,
            batch_max_queue_s=h.batch_max_queue_s,
            class_slo_ms=h.class_slo_ms,
        )

    def pipeline_settings(self) -> PipelineSettings:
        """The routing pipeline's settings (routing/pipeline.py) on this set-up, as the gateway
        builds them from its config (gateway/serving/planner.py pipeline_settings)."""
        return PipelineSettings(
            policy=Policy(self.policy),
            block_size_tokens=self.block_size_tokens,
            fallback=Fallback(self.critical_fallback),
            critical_budget_ms=self.critical_budget_ms,
            cost_placement=self.critical_placement == "cost",
            clear_while_loading=self.clear_while_loading,
            batch_max_queue_s=self.batch_max_queue_s,
            remote_write={p.name: p.remote_write for p in self.pools},
            precise=self.mode == "precise",
            slo_ms={TenantClass(k): v for k, v in self.class_slo_ms.items()},
        )

    def terms_of(self, pool: PoolSetup) -> CostTerms:
        return self.terms.get(pool.name, CostTerms.seed(pool.costs))

    def with_pools(self, name: str, pools: tuple[PoolSetup, ...], **changes: object) -> Setup:
        return replace(self, name=name, pools=pools, **changes)  # type: ignore[arg-type]

    def with_replicas(self, pool: str, replicas: int) -> Setup:
        pools = tuple(replace(p, replicas=replicas) if p.name == pool else p for p in self.pools)
        return replace(self, pools=pools)


Scenario = Callable[[Setup], Setup]


def hbm_only(base: Setup) -> Setup:
    pools = tuple(replace(p, cpu_capacity_tokens=0, remote_tier=None) for p in base.pools)
    return base.with_pools("HBM only", pools)


def with_cpu(cpu_tokens: int) -> Scenario:
    """Every pool's replicas get a CPU tier (`cpu_tokens` where the pool had none); no remote."""

    def apply(base: Setup) -> Setup:
        pools = tuple(
            replace(p, cpu_capacity_tokens=p.cpu_capacity_tokens or cpu_tokens, remote_tier=None)
            for p in base.pools
        )
        return base.with_pools("+ CPU tier", pools)

    return apply


def with_remote(
    cpu_tokens: int, remote_tokens: int, admission: str, lookup_s: float = 0.0
) -> Scenario:
    """CPU tier as with_cpu, and one shared remote tier (the captured one, else
    `remote_tokens`) with `admission` (reuse, always) on every pool that is not HBM-only;
    `lookup_s` per request that misses locally (Setup.remote_lookup_s), unless the base
    already had a remote tier (its fitted overhead holds the lookup then)."""

    def apply(base: Setup) -> Setup:
        tiers = dict(base.remote_tiers) or {DEFAULT_REMOTE_TIER: remote_tokens}
        tier = next(iter(tiers))
        pools = tuple(
            p
            if p.hbm_only
            else replace(
                p,
                cpu_capacity_tokens=p.cpu_capacity_tokens or cpu_tokens,
                remote_tier=p.remote_tier or tier,
                remote_write=admission,
            )
            for p in base.pools
        )
        lookup = base.remote_lookup_s if base.remote_tiers else lookup_s
        return base.with_pools(
            f"+ remote ({admission})", pools, remote_tiers=tiers, remote_lookup_s=lookup
        )

    return apply


def scaled_hbm(factor: float) -> Scenario:
    def apply(base: Setup) -> Setup:
        pools = tuple(
            replace(
                p,
                hbm_capacity_tokens=max(
                    base.block_size_tokens, int(p.hbm_capacity_tokens * factor)
                ),
            )
            for p in base.pools
        )
        return base.with_pools(f"HBM x{factor:g}", pools)

    return apply


def scaled_pcie(factor: float) -> Scenario:
    """Every replica's host-to-GPU link `factor` times as fast (a swap-in's fitted seconds per
    token divided by it): a Gen5 host for a Gen4 one is x2, a link shared by four GPUs x0.25."""

    def apply(base: Setup) -> Setup:
        pools = tuple(
            replace(p, costs=replace(p.costs, pcie_gbps=p.costs.pcie_gbps * factor))
            for p in base.pools
        )
        terms = {
            pool.name: replace(
                base.terms_of(pool),
                swap_s_per_token=base.terms_of(pool).swap_s_per_token / factor,
            )
            for pool in base.pools
        }
        return base.with_pools(f"PCIe x{factor:g}", pools, terms=terms)

    return apply


def pinned(replicas: int, tenants: frozenset[str] = frozenset()) -> Scenario:
    """A pinned, HBM-only pool of `replicas` for critical traffic (the captured critical class,
    plus `tenants` served as critical): the captured pinned pool resized, else one carved out of
    the largest pool (which keeps at least one replica)."""

    def apply(base: Setup) -> Setup:
        label = f"pinned {replicas} for critical"
        critical = base.critical_tenants | tenants
        if any(p.pinned for p in base.pools):
            first = next(p for p in base.pools if p.pinned)
            pools = tuple(replace(p, replicas=replicas) if p is first else p for p in base.pools)
            return base.with_pools(label, pools, critical_tenants=critical)
        donors = list(base.pools)
        if not donors:
            return base.with_pools(label, base.pools)
        donor = max(donors, key=lambda p: p.replicas)
        kept = max(1, donor.replicas - replicas)
        pin = replace(
            donor,
            name=PINNED_POOL,
            replicas=replicas,
            cpu_capacity_tokens=0,
            remote_tier=None,
            pinned=True,
            hbm_only=True,
            replica_names=(),
        )
        pools = (*(replace(p, replicas=kept) if p is donor else p for p in base.pools), pin)
        terms = {**base.terms, PINNED_POOL: base.terms_of(donor)}
        return base.with_pools(label, pools, terms=terms, critical_tenants=critical)

    return apply


def scenarios(
    *,
    cpu_tokens: int,
    remote_tokens: int,
    pin_replicas: int,
    critical_tenants: frozenset[str] = frozenset(),
    remote_lookup_s: float = 0.0,
    hbm_factors: tuple[float, ...] = (0.5, 2.0),
    pcie_factors: tuple[float, ...] = (0.25, 4.0),
) -> dict[str, Scenario]:
    """The standard comparison, by short name (the CLI's --scenarios)."""
    out: dict[str, Scenario] = {
        "captured": lambda base: base,
        "hbm": hbm_only,
        "cpu": with_cpu(cpu_tokens),
        "remote-reuse": with_remote(cpu_tokens, remote_tokens, "reuse", remote_lookup_s),
        "remote-always": with_remote(cpu_tokens, remote_tokens, "always", remote_lookup_s),
        "pinned": pinned(pin_replicas, critical_tenants),
    }
    for f in hbm_factors:
        out[f"hbm-x{f:g}"] = scaled_hbm(f)
    for f in pcie_factors:
        out[f"pcie-x{f:g}"] = scaled_pcie(f)
    return out
