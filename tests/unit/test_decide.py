import dataclasses
import random

import pytest

from routing.cost import Load, Overlap, Queued, estimate, seeded
from routing.decide import (
    Candidate,
    NoCandidates,
    Policy,
    PoolRules,
    Reason,
    RouteRequest,
    Score,
    decide,
    overlap_of,
    rescored,
    runs_of,
)
from routing.types import BlockHits, Location, Tier

B = 16  # block size in tokens


def hbm(r: str) -> Location:
    return Location(r, Tier.HBM)


def cpu(r: str) -> Location:
    return Location(r, Tier.CPU)


REMOTE = Location("kv", Tier.REMOTE)


def hits(*blocks: set[Location]) -> BlockHits:
    return [frozenset(b) for b in blocks]


def request(blocks: int, extra_tokens: int = 0) -> RouteRequest:
    return RouteRequest(list(range(blocks)), blocks * B + extra_tokens, B)


@pytest.mark.parametrize(
    ("block_hits", "hbm_only_pool", "expected"),
    [
        (hits(), False, (0, 0, 0)),
        (hits({hbm("a")}, {hbm("a")}), False, (32, 0, 0)),
        (hits({hbm("a")}, {cpu("a")}, {cpu("a")}), False, (16, 32, 0)),
        (hits({hbm("a")}, {cpu("a")}, {REMOTE}, {REMOTE}), False, (16, 16, 32)),
        (hits({cpu("a")}, {hbm("a")}), False, (0, 32, 0)),
        (hits({hbm("b")}, {hbm("a")}), False, (0, 0, 0)),
        (hits({REMOTE}, {hbm("a")}), False, (0, 0, 32)),
        (hits({hbm("a")}, {cpu("a")}, {REMOTE}), True, (16, 0, 0)),
    ],
    ids=[
        "nothing",
        "hbm-prefix",
        "hbm-then-cpu",
        "hbm-cpu-remote",
        "cpu-first-block",
        "other-replica-only",
        "remote-then-hbm",
        "hbm-only-pool",
    ],
)
def test_overlap_of(
    block_hits: BlockHits, hbm_only_pool: bool, expected: tuple[int, int, int]
) -> None:
    cand = Candidate("a", remote_tier="kv", pool=PoolRules(hbm_only=hbm_only_pool))
    ov = overlap_of(cand, runs_of(block_hits), request(4, 7))
    assert (ov.hbm_tokens, ov.cpu_tokens, ov.remote_tokens) == expected


def test_overlap_is_capped_by_prompt() -> None:
    runs = runs_of(hits({hbm("a")}, {hbm("a")}))
    assert runs == [(frozenset({hbm("a")}), 2)]
    ov = overlap_of(Candidate("a"), runs, RouteRequest([1, 2], 20, B))
    assert ov == Overlap(20, hbm_tokens=20)


def choose(
    policy: Policy,
    candidates: list[Candidate],
    block_hits: BlockHits,
    req: RouteRequest,
    seq: int = 0,
) -> tuple[str, Reason]:
    d = decide(req, candidates, block_hits, policy, seq=seq, rng=random.Random(0))
    return d.replica, d.reason


CACHE_AWARE_CASES = [
    (
        "cold-idle-fleet-takes-least-loaded",
        [Candidate("a", Load(2)), Candidate("b", Load(0))],
        hits(),
        ("b", Reason.COLD),
    ),
    (
        "hbm-hit-wins",
        [Candidate("a"), Candidate("b")],
        hits(*[{hbm("b")}] * 100),
        ("b", Reason.HBM_HIT),
    ),
    (
        "cpu-hit-beats-recompute",
        [Candidate("a"), Candidate("b")],
        hits(*[{cpu("b")}] * 100),
        ("b", Reason.CPU_HIT),
    ),
    (
        "remote-hit-beats-recompute",
        [Candidate("a"), Candidate("b", remote_tier="kv")],
        hits(*[{REMOTE}] * 200),
        ("b", Reason.REMOTE_HIT),
    ),
    (
        "queue-beats-cache",
        [Candidate("a", Load(8, 200_000)), Candidate("b")],
        hits(*[{hbm("a")}] * 100),
        ("b", Reason.QUEUE),
    ),
    (
        "small-queue-still-loses-to-cache",
        [Candidate("a", Load(1, 500)), Candidate("b")],
        hits(*[{hbm("a")}] * 100),
        ("a", Reason.HBM_HIT),
    ),
]


@pytest.mark.parametrize(
    ("candidates", "block_hits", "expected"),
    [c[1:] for c in CACHE_AWARE_CASES],
    ids=[c[0] for c in CACHE_AWARE_CASES],
)
def test_cache_aware(
    candidates: list[Candidate], block_hits: BlockHits, expected: tuple[str, Reason]
) -> None:
    n = max(len(block_hits), 1)
    assert choose(Policy.CACHE_AWARE, candidates, block_hits, request(n)) == expected


def test_round_robin_cycles() -> None:
    cands = [Candidate("a"), Candidate("b"), Candidate("c")]
    got = [choose(Policy.ROUND_ROBIN, cands, hits(), request(1), seq=i)[0] for i in range(4)]
    assert got == ["a", "b", "c", "a"]


def test_least_loaded() -> None:
    cands = [Candidate("a", Load(3)), Candidate("b", Load(1)), Candidate("c", Load(1, 100))]
    assert choose(Policy.LEAST_LOADED, cands, hits(), request(1)) == ("b", Reason.LEAST_LOADED)


def test_prefix_hash_is_sticky_and_bounded() -> None:
    cands = [Candidate(n) for n in "abcd"]
    req = request(8)
    first, reason = choose(Policy.PREFIX_HASH, cands, hits(), req)
    assert reason is Reason.PREFIX_HASH
    assert choose(Policy.PREFIX_HASH, cands, hits(), req)[0] == first
    loaded = [Candidate(c.name, Load(10 if c.name == first else 0)) for c in cands]
    spilled, reason = choose(Policy.PREFIX_HASH, loaded, hits(), req)
    assert spilled != first and reason is Reason.PREFIX_HASH_SPILL


def test_decision_is_deterministic_for_a_seed() -> None:
    cands = [Candidate(n) for n in "abcd"]
    a = [
        decide(request(2), cands, hits(), Policy.CACHE_AWARE, seq=0, rng=random.Random(7))
        for _ in range(3)
    ]
    assert len({d.ranking for d in a}) == 1


def test_no_candidates() -> None:
    with pytest.raises(NoCandidates):
        decide(request(1), [], hits(), Policy.CACHE_AWARE, seq=0, rng=random.Random(0))


def test_shared_system_prompt_does_not_pile_onto_one_replica() -> None:
    """Every request shares one 2,000-token system prompt. Longest-prefix routers send all of
    them to the replica that first cached it; the queueing term spreads them once that
    replica's prefill queue costs more than recomputing the prompt elsewhere."""
    names = ["r0", "r1", "r2", "r3"]
    load = {n: Load() for n in names}
    holders: set[str] = set()
    system_blocks = 125  # 2,000 tokens
    rng = random.Random(1)
    chosen: list[str] = []
    reasons: set[Reason] = set()
    for seq in range(64):
        block_hits = hits(*[{hbm(h) for h in holders}] * system_blocks) if holders else hits()
        cands = [Candidate(n, load[n]) for n in names]
        req = RouteRequest(list(range(system_blocks + 8)), (system_blocks + 8) * B, B)
        d = decide(req, cands, block_hits, Policy.CACHE_AWARE, seq=seq, rng=rng)
        s = d.score()
        # nobody finishes in this burst: every request stays queued on its replica
        load[d.replica] = Load(
            load[d.replica].in_flight + 1,
            load[d.replica].pending_prefill_tokens + s.overlap.uncached_tokens,
        )
        holders.add(d.replica)
        chosen.append(d.replica)
        reasons.add(d.reason)
    counts = {n: chosen.count(n) for n in names}
    assert min(counts.values()) > 0, counts
    assert max(counts.values()) <= 1.5 * len(chosen) / len(names), counts
    assert Reason.QUEUE in reasons, "the queueing term is what spread the load"


def test_every_configurable_policy_is_registered() -> None:
    from routing.policies import POLICIES, Policy

    assert set(POLICIES) == set(Policy)
    for policy, impl in POLICIES.items():
        decision = decide(
            RouteRequest([1, 2], 32, 16),
            [Candidate("a"), Candidate("b")],
            [],
            policy,
            seq=0,
            rng=random.Random(0),
        )
        assert decision.policy is policy, impl
        assert sorted(decision.ranking) == ["a", "b"]


def test_an_urgent_request_goes_to_its_cache_past_standard_work_it_will_overtake() -> None:
    """Replica a holds the 16k-token prompt and has 200k standard tokens waiting behind a short
    prefill in progress (sent after its step was formed: not running yet). Where the engines
    schedule by priority, a critical request (-1) overtakes that queue and goes to its cache
    (one step, which the waiting work fills); a standard one (0), or any request where they do
    not, waits for it and goes to b. (The waiting request used to be sent before the step under
    way: vLLM gives it that step's spare budget, a partial first chunk, so it runs and nothing
    overtakes it.)"""
    queued = (Queued(-0.1, 1000, priority=0), Queued(-0.005, 200_000, priority=0))
    busy = Load(2, 201_000, busy_s=0.01, queue=queued)
    block_hits = hits(*[{hbm("a")}] * 1000)
    for engine_priority, priority, expected in [
        (True, -1, "a"),
        (True, 0, "b"),
        (False, -1, "b"),
    ]:
        rules = PoolRules(engine_priority=engine_priority)
        cands = [Candidate("a", busy, pool=rules), Candidate("b", pool=rules)]
        req = RouteRequest(list(range(1000)), 1000 * B, B, priority=priority)
        assert choose(Policy.CACHE_AWARE, cands, block_hits, req)[0] == expected


def test_an_urgent_request_does_not_jump_a_queue_to_save_less_than_it_costs_the_others() -> None:
    """Replica a holds half of a 16k-token prompt and has five standard requests waiting; b is
    idle and cold. Jumping a's queue would save the critical request 8,000 tokens of prefill
    and delay each of the five by its own 8,000: it goes to b. Holding the whole prompt (no
    prefill to impose) it goes to a. (The prompt was 1,600 tokens: on a budget of 8,192 its
    one step on a is full of the queue it jumped, longer than its whole prefill on b.)"""
    queued = tuple(Queued(-0.1 + i * 0.01, 3000, priority=0) for i in range(6))
    busy = Load(6, 18_000, busy_s=0.099, queue=queued)  # the head is nearly done
    rules = PoolRules(engine_priority=True)
    cands = [Candidate("a", busy, pool=rules), Candidate("b", pool=rules)]
    req = RouteRequest(list(range(1000)), 1000 * B, B, priority=-1)
    half = hits(*[{hbm("a")}] * 500)
    assert choose(Policy.CACHE_AWARE, cands, half, req)[0] == "b"
    whole = hits(*[{hbm("a")}] * 1000)
    assert choose(Policy.CACHE_AWARE, cands, whole, req)[0] == "a"


def test_a_long_prefill_goes_where_it_does_not_make_a_loading_request_wait() -> None:
    """Both replicas are idle and cold for this prompt; on "a" a request fetching its KV joins
    the prefill in 20 ms. Its estimate is the same on both, but on "a" the other one would wait
    for its whole prefill: it goes to "b"."""
    fetching = Load(1, 600, queue=(Queued(0.02, 600),))
    candidates = [Candidate("a", fetching), Candidate("b", Load(1))]
    for seed in range(10):  # not a tie broken by chance
        d = decide(
            request(400), candidates, hits(), Policy.CACHE_AWARE, seq=0, rng=random.Random(seed)
        )
        assert d.replica == "b"


def test_a_score_rescored_is_the_decisions_snapshot_at_other_terms() -> None:
    """The fit re-derives a request's features from the decision's snapshot at the terms it
    has learnt since: 30k tokens queued, 0.4 s worked on, of which the seed's rate takes 18k
    tokens ahead still, a rate 10x slower nearly all."""
    candidate = Candidate("r0", load=Load(pending_prefill_tokens=30_000, busy_s=0.4))
    seed = seeded(candidate.costs)
    score = Score("r0", Overlap(2000), estimate(Overlap(2000), candidate.load, candidate.costs))
    slower = seed.scaled(10.0)
    again = rescored(score, candidate, slower, None)
    assert again.estimate == estimate(Overlap(2000), candidate.load, candidate.costs, slower)
    assert score.estimate.queue_tokens < 20_000 < 28_000 < again.estimate.queue_tokens
    assert (again.replica, again.overlap) == (score.replica, score.overlap)


def test_a_rescored_score_keeps_the_remote_tier_choice_the_decision_made() -> None:
    """Fetched at the seed's rates; at a network 100x slower it would be recomputed, but the
    request was sent to fetch it: the score stays as it was."""
    candidate = Candidate("r0")
    overlap = Overlap(4000, remote_tokens=3000)
    score = Score("r0", overlap, estimate(overlap, candidate.load, candidate.costs))
    assert score.estimate.remote_fetch
    seed = seeded(candidate.costs)
    slow_network = dataclasses.replace(seed, fetch_s_per_token=seed.fetch_s_per_token * 100)
    assert rescored(score, candidate, slow_network, None) is score
