"""The what-if planner's core (routing/whatif/): the cache model, the capture format, the replay's
determinism and queueing, the scenarios and the replica search. Pure: no servers."""

from __future__ import annotations

import ast
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from routing.cost import CostTerms, PoolCosts
from routing.whatif.cache import RemoteTier, ReplicaCache
from routing.whatif.capture import (
    VERSION,
    CapturedRequest,
    CaptureError,
    HitTiers,
    PoolSetup,
    hex_hashes,
    hit_tiers,
    parse_capture,
)
from routing.whatif.replay import replay
from routing.whatif.setup import (
    Setup,
    hbm_only,
    pinned,
    scaled_hbm,
    scaled_pcie,
    with_cpu,
    with_remote,
)
from routing.whatif.summary import percentile, replicas_needed, summarize

BS = 16

# --- the cache model ---------------------------------------------------------------------------


def test_hbm_overflow_is_demoted_to_cpu_tail_first() -> None:
    cache = ReplicaCache(hbm_blocks=4, cpu_blocks=4)
    cache.place([1, 2, 3, 4], swapped_in=[])
    placed = cache.place([5, 6], swapped_in=[])
    # a prompt is placed last block first, so the previous prompt's tail (4, 3) went first
    assert placed.evicted_hbm == 2 and placed.demoted_cpu == 2
    assert cache.local_prefix([1, 2, 3, 4]) == (2, 2)  # 1, 2 in HBM; 3, 4 in the CPU tier
    assert cache.local_prefix([5, 6]) == (2, 0)


def test_cpu_overflow_is_dropped() -> None:
    cache = ReplicaCache(hbm_blocks=2, cpu_blocks=2)
    for prompt in ([1, 2], [3, 4], [5, 6], [7, 8]):
        cache.place(prompt, swapped_in=[])
    assert cache.local_prefix([1, 2]) == (0, 0)  # HBM -> CPU -> gone
    assert cache.local_prefix([5, 6]) == (0, 2)
    assert cache.local_prefix([7, 8]) == (2, 0)


def test_without_cpu_tier_hbm_evictions_are_lost() -> None:
    cache = ReplicaCache(hbm_blocks=2, cpu_blocks=0)
    cache.place([1, 2], swapped_in=[])
    placed = cache.place([3, 4], swapped_in=[])
    assert placed.evicted_hbm == 2 and placed.demoted_cpu == 0
    assert cache.local_prefix([1, 2]) == (0, 0)


def test_remote_tier_counts_writes_never_read() -> None:
    tier = RemoteTier(capacity_blocks=4)
    assert tier.write([1, 2]) == 2
    assert tier.write([1, 2]) == 0  # held already: no bytes written
    assert tier.lookup([1, 2, 9]) == 2
    tier.read([1, 2])
    assert tier.write([3, 4, 5, 6]) == 4  # evicts 1 and 2, both read
    assert tier.stats.evicted_blocks == 2 and tier.stats.evicted_unread_blocks == 0
    tier.write([7, 8])  # evicts two of 3..6, never read
    assert tier.stats.evicted_unread_blocks == 2
    assert tier.resident_unread() == 4
    assert tier.stats.written_blocks == 8


# --- the capture format ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expected", "cached", "split"),
    [
        ((100, 50, 30), None, (100, 50, 30)),
        ((100, 50, 30), 180, (100, 50, 30)),
        ((100, 50, 30), 120, (100, 20, 0)),  # a shortfall: remote first, then CPU
        ((100, 50, 30), 40, (40, 0, 0)),
        ((100, 0, 0), 160, (160, 0, 0)),  # a surplus counts as HBM
    ],
    ids=["no-usage", "as-expected", "short-remote-cpu", "short-all", "surplus"],
)
def test_hit_tiers(
    expected: tuple[int, int, int], cached: int | None, split: tuple[int, int, int]
) -> None:
    hit = hit_tiers(500, *expected, cached)
    assert (hit.hbm, hit.cpu, hit.remote) == split
    assert hit.computed == 500 - sum(split)


def _header_obj(**pool: object) -> dict[str, object]:
    return {
        "type": "header",
        "version": VERSION,
        "block_size_tokens": BS,
        "mode": "approximate",
        "policy": "cache_aware",
        "index_ttl_s": 600.0,
        "reuse_window_s": 300.0,
        "pools": [
            {
                "name": "p",
                "replicas": ["a:1", "b:1"],
                "hbm_capacity_tokens": 1600,
                "costs": {"prefill_tokens_per_s": 10_000.0},
                **pool,
            }
        ],
        "remote_tiers": {},
    }


def _request_obj(t_s: float, hashes: list[int]) -> dict[str, object]:
    return {
        "type": "request",
        "t_s": t_s,
        "tenant": "web",
        "class": "standard",
        "model": "m",
        "endpoint": "chat",
        "stream": True,
        "pool": "p",
        "replica": "a:1",
        "reason": "cold",
        "prompt_tokens": len(hashes) * BS + 3,
        "hashes": hex_hashes(hashes),
        "est_ttft_s": 0.01,
        "ttft_s": 0.02,
        "e2e_s": 0.1,
        "engine_prompt_tokens": None,
        "cached_tokens": 0,
        "hit": {"hbm": 0, "cpu": 0, "remote": 0, "computed": len(hashes) * BS + 3},
    }


def test_parse_capture_round_trip() -> None:
    big = [2**64 - 1, 0, 12345]
    fit = {
        "type": "fit",
        "t_s": 1.0,
        "replicas": {
            "a:1": {
                "pool": "p",
                "fixed_s": 0.004,
                "prefill_s_per_token": 2e-4,
                "swap_s_per_token": 1e-6,
                "fetch_s_per_token": 2e-6,
                "samples": 60,
            }
        },
    }
    cap = parse_capture([_header_obj(), _request_obj(2.0, [7]), _request_obj(1.0, big), fit])
    assert [r.t_s for r in cap.requests] == [1.0, 2.0]  # sorted by arrival
    assert cap.requests[0].hashes == tuple(big)
    assert cap.header.pools[0].replicas == 2
    assert cap.header.pools[0].costs.prefill_tokens_per_s == 10_000.0
    assert cap.pool_terms()["p"].prefill_s_per_token == 2e-4
    assert Setup.from_capture(cap).terms["p"].samples == 60


def test_a_capture_with_the_removed_lending_knobs_is_still_read() -> None:
    """Captures written while pools had lend_keep_idle and lend_max_prefill_tokens (removed:
    docs/critical.md, "A pinned pool") carry them in the header; they are read and ignored."""
    old = {"pinned": True, "lend_below": 1.0, "lend_keep_idle": 1, "lend_max_prefill_tokens": 1092}
    line = json.dumps(_header_obj(**old))
    cap = parse_capture([json.loads(line), _request_obj(1.0, [7])])
    pool = cap.header.pools[0]
    assert (pool.pinned, pool.lend_below) == (True, 1.0)
    assert len(replay(cap.requests, Setup.from_capture(cap)).requests) == 1


@pytest.mark.parametrize(
    "objects",
    [
        [_request_obj(1.0, [1])],
        [{**_header_obj(), "version": 99}],
        [_header_obj(), {"type": "nonsense"}],
        [_header_obj(), {"type": "request", "t_s": 1.0}],
    ],
    ids=["no-header", "version", "unknown-type", "missing-fields"],
)
def test_parse_capture_rejects(objects: list[dict[str, object]]) -> None:
    with pytest.raises(CaptureError):
        parse_capture(objects)


# --- the replay --------------------------------------------------------------------------------

PREFILL_S_PER_TOKEN = 1e-4  # 10k tokens/s: a 1,600-token prefill takes 160 ms


def _setup(replicas: int = 2, hbm_tokens: int = 4_000, cpu_tokens: int = 0) -> Setup:
    pool = PoolSetup(
        "p",
        replicas,
        hbm_tokens,
        cpu_tokens,
        costs=PoolCosts(prefill_tokens_per_s=1 / PREFILL_S_PER_TOKEN, fixed_s=0.0),
    )
    return Setup(
        name="test",
        pools=(pool,),
        remote_tiers={},
        block_size_tokens=BS,
        policy="cache_aware",
        mode="approximate",
        index_ttl_s=600.0,
        reuse_window_s=300.0,
        terms={"p": CostTerms.seed(pool.costs)},
    )


def _req(
    t_s: float, hashes: list[int], tenant: str = "web", klass: str = "standard"
) -> CapturedRequest:
    tokens = len(hashes) * BS + 1
    return CapturedRequest(
        t_s=t_s,
        tenant=tenant,
        tenant_class=klass,
        model="m",
        pool="p",
        replica="p-0",
        prompt_tokens=tokens,
        hashes=tuple(hashes),
        stream=True,
        ttft_s=0.01,
        e2e_s=0.05,
        cached_tokens=0,
        hit=HitTiers(0, 0, 0, tokens),
        est_ttft_s=0.01,
    )


def _trace(seed: int, n: int = 300) -> list[CapturedRequest]:
    """Documents of 40-120 blocks with Zipf-like popularity, Poisson arrivals, two tenants."""
    rng = random.Random(seed)
    docs = [[rng.getrandbits(64) for _ in range(rng.randint(40, 120))] for _ in range(12)]
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(8.0)
        doc = docs[min(int(rng.paretovariate(1.0)) - 1, len(docs) - 1)]
        tail = [rng.getrandbits(64) for _ in range(rng.randint(1, 4))]
        voice = rng.random() < 0.3
        out.append(
            _req(t, doc + tail, "voice" if voice else "web", "critical" if voice else "standard")
        )
    return out


def test_replay_is_deterministic_for_a_seed() -> None:
    trace, setup = _trace(1), with_cpu(2_000)(_setup(replicas=3))
    a = summarize(replay(trace, setup, seed=7))
    b = summarize(replay(trace, setup, seed=7))
    assert a == b
    assert a.classes["all"].requests == len(trace)


def test_replay_queues_prefills_one_at_a_time() -> None:
    """Three cold 1,600-token prompts at once on one replica: each waits for the ones before
    it (160 ms of prefill each), so the TTFTs are 160, 320 and 480 ms."""
    trace = [_req(0.0, [i * 1000 + b for b in range(100)]) for i in range(3)]
    out = replay(trace, _setup(replicas=1, hbm_tokens=100_000), seed=0)
    ttfts = sorted(round(r.ttft_s, 4) for r in out.requests)
    one = 1601 * PREFILL_S_PER_TOKEN
    assert ttfts == [round(one, 4), round(2 * one, 4), round(3 * one, 4)]
    assert sorted(round(r.queue_s, 4) for r in out.requests) == [
        0.0,
        round(one, 4),
        round(2 * one, 4),
    ]


def test_replay_reuses_hbm_and_routes_to_it() -> None:
    doc = list(range(100))
    trace = [_req(0.0, doc), _req(1.0, [*doc, 999])]
    out = replay(trace, _setup(replicas=4, hbm_tokens=100_000), seed=0)
    first, second = out.requests
    assert first.hbm_tokens == 0
    assert second.replica == first.replica  # the router found it where the first one went
    assert second.hbm_tokens == 100 * BS
    assert second.computed_tokens == second.prompt_tokens - 100 * BS


def test_cpu_tier_serves_what_hbm_evicted() -> None:
    a, b = list(range(100)), list(range(1000, 1100))
    trace = [_req(0.0, a), _req(1.0, b), _req(2.0, [*a, 99_999])]
    hbm = _setup(replicas=1, hbm_tokens=100 * BS)
    cpu = with_cpu(200 * BS)(hbm)
    assert replay(trace, hbm, seed=0).requests[2].cpu_tokens == 0
    third = replay(trace, cpu, seed=0).requests[2]
    assert third.cpu_tokens == 100 * BS and third.pcie_bytes == 100 * BS * 131_072


def test_remote_admission_reuse_writes_less_than_always() -> None:
    """Unique prompts only: `always` writes every one and none is ever read; `reuse` writes
    none of them."""
    rng = random.Random(3)
    trace = [_req(i * 0.5, [rng.getrandbits(64) for _ in range(60)]) for i in range(40)]
    base = _setup(replicas=2)
    always = summarize(replay(trace, with_remote(0, 10_000_000, "always")(base), seed=0))
    reuse = summarize(replay(trace, with_remote(0, 10_000_000, "reuse")(base), seed=0))
    assert always.remote_written_bytes > 0
    assert always.remote_never_read_bytes == always.remote_written_bytes
    assert reuse.remote_written_bytes == 0


def test_remote_tier_serves_a_document_evicted_locally() -> None:
    doc = list(range(200))
    others = [[10_000 * (i + 1) + b for b in range(200)] for i in range(3)]
    trace = [_req(0.0, doc), *[_req(1.0 + i, o) for i, o in enumerate(others)], _req(9.0, doc)]
    base = _setup(replicas=1, hbm_tokens=200 * BS)
    last = replay(trace, with_remote(0, 10_000_000, "always")(base), seed=0).requests[-1]
    assert last.remote_tokens > 0 and last.fetched_bytes > 0
    assert replay(trace, hbm_only(base), seed=0).requests[-1].remote_tokens == 0


def test_pinned_pool_takes_critical_traffic_only() -> None:
    trace = _trace(2)
    out = replay(trace, pinned(1)(_setup(replicas=3)), seed=0)
    pools = {(r.tenant_class, r.pool) for r in out.requests}
    assert ("critical", "pinned") in pools
    assert ("standard", "pinned") not in pools


def test_replay_sheds_batch_behind_a_long_queue_as_the_gateway_does() -> None:
    """Three cold 1,600-token prompts queued on one replica (~480 ms of prefill): a batch request
    over the set-up's 100 ms bound is refused, counted as rejected and as shed."""
    trace = [_req(0.0, [i * 1000 + b for b in range(100)]) for i in range(3)]
    trace.append(_req(0.0, [9000 + b for b in range(10)], "jobs", "batch"))
    setup = replace(_setup(replicas=1, hbm_tokens=100_000), batch_max_queue_s=0.1)
    out = replay(trace, setup, seed=0)
    assert out.rejected == {"batch": 1}
    assert out.shed == {"batch": 1}
    assert len(out.requests) == 3


@pytest.mark.parametrize("priority", [False, True], ids=["first-come", "engine-priority"])
def test_an_engine_priority_pool_prefills_critical_before_standard(priority: bool) -> None:
    """One replica busy with a prefill; a standard and then a critical request join its queue:
    a pool with engine_priority serves the critical one first, as vLLM's priority scheduling
    does."""
    trace = [
        _req(0.0, [1000 + b for b in range(100)]),
        _req(0.0, [2000 + b for b in range(100)]),
        _req(0.0, [3000 + b for b in range(100)], "voice", "critical"),
    ]
    base = _setup(replicas=1, hbm_tokens=100_000)
    setup = replace(base, pools=tuple(replace(p, engine_priority=priority) for p in base.pools))
    out = replay(trace, setup, seed=0)
    ttft = {r.tenant_class: r.ttft_s for r in out.requests if r.queue_s > 0}
    assert (ttft["critical"] < ttft["standard"]) is priority


def test_pinned_scenario_resizes_a_captured_pinned_pool() -> None:
    base = pinned(1)(_setup(replicas=4))
    assert {p.name: p.replicas for p in base.pools} == {"p": 3, "pinned": 1}
    again = pinned(2, frozenset({"web"}))(base)
    assert {p.name: p.replicas for p in again.pools} == {"p": 3, "pinned": 2}
    assert again.critical_tenants == {"web"}
    out = replay(_trace(2), again, seed=0)
    assert {r.pool for r in out.requests if r.tenant == "web"} == {"pinned"}


def test_a_slower_pcie_link_makes_swap_ins_slower() -> None:
    a, b = list(range(100)), list(range(1000, 1100))
    trace = [_req(0.0, a), _req(1.0, b), _req(2.0, [*a, 99_999])]
    cpu = with_cpu(200 * BS)(_setup(replicas=1, hbm_tokens=100 * BS))
    fast = replay(trace, cpu, seed=0).requests[2]
    slow = replay(trace, scaled_pcie(0.25)(cpu), seed=0).requests[2]
    assert slow.cpu_tokens == fast.cpu_tokens > 0
    swap_s = fast.cpu_tokens * 131_072 / (50e9 * 0.25) - fast.cpu_tokens * 131_072 / 50e9
    assert slow.ttft_s - fast.ttft_s == pytest.approx(swap_s)


def test_more_hbm_never_lowers_the_hit_rate_here() -> None:
    trace = _trace(4)
    small = summarize(replay(trace, scaled_hbm(0.5)(_setup()), seed=0)).classes["all"]
    large = summarize(replay(trace, scaled_hbm(4.0)(_setup()), seed=0)).classes["all"]
    assert large.hit_rate > small.hit_rate


def test_replicas_needed_meets_the_target_and_one_fewer_does_not() -> None:
    trace = _trace(5, n=200)
    setup = _setup(replicas=1)
    needed = replicas_needed(trace, setup, "standard", target_ms=400.0)
    assert needed is not None and needed.replicas is not None
    assert needed.ttft_ms <= 400.0
    if needed.replicas > 1:
        fewer = replay(trace, setup.with_replicas("p", needed.replicas - 1), seed=0)
        p99 = percentile(
            [r.ttft_s * 1000 for r in fewer.requests if r.tenant_class == "standard"], 99
        )
        assert p99 > 400.0


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0


# --- purity ------------------------------------------------------------------------------------

FORBIDDEN = {
    "fastapi", "starlette", "httpx", "uvicorn", "aiohttp", "requests", "gateway", "loadtest",
    "redis", "asyncio", "prometheus_client", "os", "pathlib", "io", "socket", "threading",
    "time", "json", "matplotlib",
}  # fmt: skip
WHATIF = Path(__file__).resolve().parents[2] / "routing" / "whatif"


@pytest.mark.parametrize("path", sorted(WHATIF.glob("*.py")), ids=lambda p: p.name)
def test_whatif_is_pure(path: Path) -> None:
    tree = ast.parse(path.read_text())
    imported, called = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            called.add(node.func.id)
    assert not imported & FORBIDDEN, f"{path.name} imports {imported & FORBIDDEN}"
    assert not called & {"open", "print", "input"}, f"{path.name} does IO"
