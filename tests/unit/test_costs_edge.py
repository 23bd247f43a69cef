"""gateway/accounting/ledger.py: HBM churn from index removals, the snapshot, windows."""

from __future__ import annotations

import pytest

from gateway.accounting.ledger import CostAccounting
from gateway.config import parse_config
from gateway.fleet.registry import Registry
from gateway.telemetry.metrics import Metrics
from routing.index import MemoryIndex
from routing.types import Location, Tier

URLS = ["http://127.0.0.1:9101", "http://127.0.0.1:9102"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def setup(clock: Clock) -> tuple[CostAccounting, MemoryIndex]:
    config = parse_config(
        {
            "auth": {"mode": "open"},
            "pools": [
                {
                    "name": "p",
                    "models": ["m"],
                    "replicas": URLS,
                    "hbm_capacity_tokens": 64,  # 4 blocks of 16
                    "cpu_capacity_tokens": 64,
                }
            ],
        }
    )
    registry = Registry(config)
    costs = CostAccounting(config, registry, Metrics(), clock=clock)
    index = MemoryIndex(
        ttl_s=10.0,
        capacity_blocks=lambda loc: 4,
        spill_to=lambda loc: Location(loc.holder, Tier.CPU) if loc.tier is Tier.HBM else None,
        clock=clock,
        on_removed=costs.index_removed,
    )
    return costs, index


def evicted(costs: CostAccounting, window_s: float = 60.0) -> float:
    (pool,) = costs.snapshot(window_s)["pools"]
    assert pool["hbm_capacity_blocks"] == 2 * 4
    return float(pool["hbm_evicted_blocks"])


async def test_hbm_churn_counts_capacity_and_engine_evictions_only() -> None:
    clock = Clock()
    costs, index = setup(clock)
    hbm = Location("127.0.0.1:9101", Tier.HBM)
    await index.record("m", [1, 2, 3, 4, 5, 6], hbm)  # 2 pushed out of HBM (to the CPU tier)
    assert evicted(costs) == 2
    await index.evict("m", [5, 6, 99], hbm)  # an engine's BlockRemoved: 2 were held
    assert evicted(costs) == 4
    clock.now += 11.0  # past the TTL: expiry is not churn
    index.sweep(100)
    await index.drop_replica("127.0.0.1:9101")  # a replica gone is not churn either
    assert evicted(costs) == 4
    clock.now += 60.0
    assert evicted(costs, 60.0) == 0  # slid out of the 1-minute window
    assert evicted(costs, 3600.0) == 4


def test_snapshot_shape() -> None:
    costs, _ = setup(Clock())
    snap = costs.snapshot(900.0)
    assert snap["window_s"] == 900.0 and snap["rows"] == [] and snap["remote_tiers"] == []
    assert snap["pools"][0]["pool"] == "p" and snap["pools"][0]["cpu_tier"] is True


@pytest.mark.parametrize("cause", ["expired", "dropped"])
def test_removals_that_are_not_churn(cause: str) -> None:
    costs, _ = setup(Clock())
    costs.index_removed(Location("127.0.0.1:9101", Tier.HBM), 7, cause)
    costs.index_removed(Location("127.0.0.1:9101", Tier.CPU), 7, "capacity")
    costs.index_removed(Location("elsewhere:1", Tier.HBM), 7, "capacity")
    assert evicted(costs) == 0
