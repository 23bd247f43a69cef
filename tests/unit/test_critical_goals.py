"""critical_results: excess over each request's own floor, SLO attainment, and the goal ratios
against the best peer router and against no tenants."""

from __future__ import annotations

import dataclasses
import math
from typing import cast

import pytest

from gateway.config import parse_config
from gateway.config.engines import EngineConfig
from loadtest.bench.critical import CACHELANE_ARMS, gateway_config
from loadtest.bench.critical_fleet import ENGINES, Fleet
from loadtest.bench.critical_results import ArmResult, CriticalResult, goal_ratios, meets
from loadtest.workloads import critical_traces as ct

FLEET = Fleet(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], "http://127.0.0.1:3")


def arm(name: str, ttft_ms: list[float], *, floors: list[float], hit: float = 0.5) -> ArmResult:
    """Alternating critical (voice) and standard (chat) requests, all answered."""
    results = []
    for i, t in enumerate(ttft_ms):
        tenant, klass = ("voice", "critical") if i % 2 == 0 else ("chat", "standard")
        r = CriticalResult(i, tenant, "chat", float(i), tenant_class=klass)
        r.status, r.ttft_s = 200, t / 1000
        r.prompt_tokens, r.cached_tokens = 100, round(100 * hit)
        results.append(r)
    return ArmResult(name, 10.0, results, {}, list(floors))


def test_excess_is_ttft_minus_the_request_s_own_floor_and_shed_misses_the_slo() -> None:
    a = arm("priority", [300.0, 900.0, 700.0, 1_200.0], floors=[100.0, 50.0, 200.0, 50.0])
    assert sorted(a.excess_ms("critical")) == [200.0, 500.0]
    assert a.slo_attained("critical") == 0.5  # 300 ms within 500, 700 ms not
    a.results[1].status = 503
    assert a.stats("standard")["shed"] == 1
    assert a.slo_attained("standard") == 0.0  # the shed one misses, 1,200 ms is over 1 s


def test_goal_ratios_against_the_best_peer_and_no_tenants() -> None:
    floors = [100.0] * 4
    arms = {
        "no-tenants": arm("no-tenants", [400.0, 800.0, 400.0, 800.0], floors=floors),
        "pinned": arm("pinned", [200.0, 800.0, 200.0, 800.0], floors=floors, hit=0.6),
        "sglang": arm("sglang", [500.0, 1_000.0, 500.0, 1_000.0], floors=floors),
        "vllm": arm("vllm", [300.0, 2_000.0, 300.0, 2_000.0], floors=floors, hit=0.7),
    }
    r = goal_ratios(arms)["pinned"]
    assert r["critical_excess_p99_vs_best_peer"] == pytest.approx(100 / 200)  # vllm's is lower
    assert r["all_ttft_p99_vs_best_peer"] == pytest.approx(800 / 1_000)  # sglang's is lower
    assert r["hit_rate_minus_best_peer"] == pytest.approx(0.6 - 0.7)
    assert r["critical_ttft_p99_vs_no_tenants"] == pytest.approx(0.5)
    assert r["all_ttft_p99_vs_no_tenants"] == pytest.approx(1.0)
    assert meets("critical_excess_p99_vs_best_peer", 0.5) is True
    assert meets("hit_rate_minus_best_peer", -0.1) is False
    assert meets("all_ttft_p99_vs_best_peer", math.nan) is None


def test_without_peers_the_ratios_against_them_are_unknown() -> None:
    only = {"priority": arm("priority", [300.0, 600.0], floors=[100.0, 100.0])}
    assert math.isnan(goal_ratios(only)["priority"]["critical_excess_p99_vs_best_peer"])


def test_the_control_arm_is_no_tenants_again_against_no_tenants() -> None:
    floors = [100.0] * 4
    arms = {
        "no-tenants": arm("no-tenants", [400.0, 800.0, 400.0, 800.0], floors=floors),
        "control": arm("control", [600.0, 800.0, 600.0, 800.0], floors=floors),
    }
    r = goal_ratios(arms)["control"]
    assert r == {
        "critical_ttft_p99_vs_no_tenants": pytest.approx(600 / 400),
        "all_ttft_p99_vs_no_tenants": pytest.approx(1.0),
    }
    assert gateway_config(FLEET, "control") == gateway_config(FLEET, "no-tenants")


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_cachelane_arm_declares_the_flags_the_replicas_run(name: str) -> None:
    """The gateway's cost model schedules by its pools' `engine:`; each arm's must be the sims'
    flags (the serial engine has no step budget: its policy alone)."""
    engine = ENGINES[name]
    steps = engine.step_settings()
    for arm_name in CACHELANE_ARMS:
        config = parse_config(gateway_config(FLEET, arm_name, engine))
        for pool in config.pools:
            declared = pool.engine
            assert declared.scheduling_policy == engine.scheduling_policy
            if steps is not None:
                assert declared.max_num_batched_tokens == steps.max_num_batched_tokens
                assert declared.long_prefill_token_threshold == steps.long_prefill_token_threshold
                assert declared.max_num_seqs == steps.max_num_seqs


def test_with_the_policy_alone_declared_the_cost_model_takes_vllm_s_defaults() -> None:
    """`--declare policy`: the pools name the scheduling policy and no other flag; the results
    still record the flags the replicas run."""
    engine = dataclasses.replace(ENGINES["threshold"], flags_declared=False)
    for arm_name in CACHELANE_ARMS:
        for pool in parse_config(gateway_config(FLEET, arm_name, engine)).pools:
            assert pool.engine == EngineConfig(scheduling_policy=engine.scheduling_policy)
    record = engine.to_dict()
    assert record["pools_declare"] == "policy"
    assert record["long_prefill_token_threshold"] == engine.long_prefill_token_threshold > 0


def test_pooled_seeds_keep_each_request_s_own_floor() -> None:
    from loadtest.bench.critical_report import Run, pooled_runs, ratios_table

    one = arm("priority", [300.0, 900.0], floors=[100.0, 50.0])
    two = arm("priority", [700.0, 1_200.0], floors=[200.0, 60.0])
    floor = cast("ct.Floor", None)  # the runs' floors are only carried along
    runs = [
        Run(1, "default", floor, {"priority": one}),
        Run(2, "default", floor, {"priority": two}),
        Run(3, "serial", floor, {"priority": one}),
    ]
    (both,) = pooled_runs(runs)  # one seed of serial: nothing to pool
    assert both.label == "seeds 1,2 pooled, engine default"
    assert sorted(both.arms["priority"].excess_ms("critical")) == [200.0, 500.0]
    assert sorted(both.arms["priority"].excess_ms("standard")) == [850.0, 1_140.0]
    assert ratios_table([*runs, both]).row_count == 4  # one arm per run, pooled run included
