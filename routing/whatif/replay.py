"""Replay a capture on a set-up: a discrete-event model of the fleet. Pure and deterministic for
a seed (the only randomness is routing's tie-break generator).

Each captured request arrives at its captured time and is routed by the gateway's own routing
pipeline (routing/pipeline.py: class filters and lending, decide() with the configured policy,
the critical spill or cost placement, clear_while_loading, batch shedding,
engine priority, remote admission on the family's reuse count, the index-write plan). This
module only gives it its inputs: the candidates' loads as the gateway's registry keeps them
(requests sent and not past their first token, each with its estimated join time and engine
priority; the head's progress), the gateway's own index of where prompts went (approximate mode:
routing/index.py's MemoryIndex with the HBM capacity spilling to the CPU tier, written when the
pipeline's plan says, speculative marks until then; precise mode: the engines' caches as they
are), and the pinned pool's lending reclaimed for as long as the pipeline says after a critical
request left it for lack of headroom (pinned_first only). A request the gateway would refuse (no
eligible replica, or batch traffic shed) is counted in `Outcome.rejected`.

On the chosen replica the request then runs as a replica runs it (loadtest/sim/engine.py models
the same steps for a vLLM-like engine):

  1. its prompt's blocks are looked up in the replica's HBM, CPU tier and remote tier
     (routing/whatif/cache.py; the set-up's `remote_lookup_s`, no term of the cost model);
  2. CPU blocks are swapped in (PCIe shared with the swap-ins in flight) and remote blocks
     fetched, or recomputed when cheaper: routing/cost.py's swap and remote terms;
  3. it joins the replica's prefill queue, one prefill at a time in join order (a discrete-event
     queue per replica; a pool with engine_priority serves a lower priority first, as vLLM's
     priority scheduling does): what it waits there is the TTFT's queueing term;
  4. when it starts, HBM is looked at again (blocks another request prefilled meanwhile are
     reused), and it prefills the rest at the fitted seconds per prefill token;
  5. its blocks are placed (HBM, demotion to CPU) and, if admitted, written to the remote tier;
     its first token goes out; it then decodes for as long as it did in the capture.

TTFT = the fitted fixed overhead + the time from arrival to the end of its prefill. Not modelled:
decode steps sharing the prefill's steps (the fitted prefill rate absorbs their average on a
real engine), the gateway's flow control (requests are sent at once), requests sent by other
gateways, engine preemption.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from routing.admission import ReuseWindow, family_key
from routing.cost import CostTerms, Load, Overlap, PoolCosts, Queued, estimate
from routing.decide import Candidate, PoolRules
from routing.index import MemoryIndex
from routing.pipeline import (
    FleetView,
    PipelineRequest,
    PipelineState,
    Routed,
    Write,
    admit,
    index_writes,
    reclaims_lending,
    route,
)
from routing.speculative import SPECULATIVE_TTL_S, SpeculativeIndex
from routing.types import ENGINE_PRIORITY, BlockHits, Location, TenantClass, Tier
from routing.whatif.cache import RemoteStats, RemoteTier, ReplicaCache
from routing.whatif.capture import CapturedRequest, PoolSetup
from routing.whatif.setup import Setup


@dataclass(frozen=True, slots=True)
class Replayed:
    """One request's planned outcome."""

    arrived_s: float  # the captured arrival
    tenant: str
    tenant_class: str
    pool: str
    replica: str
    ttft_s: float
    queue_s: float
    prompt_tokens: int
    hbm_tokens: int
    cpu_tokens: int
    remote_tokens: int  # fetched
    computed_tokens: int
    pcie_bytes: int
    fetched_bytes: int
    written_bytes: int


@dataclass
class Outcome:
    setup: Setup
    requests: list[Replayed]
    rejected: dict[str, int]  # class -> requests the gateway would refuse (shed ones included)
    remote: dict[str, RemoteStats]
    remote_resident_unread_blocks: int
    hbm_evicted_blocks: int
    shed: dict[str, int] = field(default_factory=dict)  # class -> of `rejected`, those shed


@dataclass
class _Job:
    id: int
    req: CapturedRequest
    tenant_class: str
    replica: _Replica
    write: bool
    arrived_s: float
    reusable: tuple[int, ...] = ()
    g: int = 0  # blocks in HBM, CPU, and fetched from the remote tier, at arrival
    c: int = 0
    fetched: int = 0
    priority: int = 0  # its place in an engine-priority pool's queue (0 elsewhere)
    joined_s: float = 0.0
    started_s: float = 0.0
    hbm_blocks: int = 0
    computed: int = 0
    loaded_writes: tuple[Write, ...] = ()  # what the index records when its KV load is done
    first_byte_writes: tuple[Write, ...] = ()  # what the index records at its first byte


@dataclass
class _Replica:
    name: str
    pool: PoolSetup
    rules: PoolRules
    terms: CostTerms
    cache: ReplicaCache
    remote: RemoteTier | None
    # the engine
    queue: list[tuple[int, float, int, _Job]] = field(default_factory=list)
    busy: bool = False
    swaps_in_flight: int = 0
    # the gateway's view (gateway/fleet/registry.py: Replica.load, Registry.reserve)
    in_flight: int = 0
    joining: dict[int, tuple[float, int, bool, int | None]] = field(default_factory=dict)
    head_since_s: float = 0.0

    @property
    def costs(self) -> PoolCosts:
        return self.pool.costs

    def load(self, now_s: float) -> Load:
        pending = sum(j[1] for j in self.joining.values())
        busy_s = 0.0
        if self.joining:
            loaded = min(j[0] for j in self.joining.values())
            busy_s = max(0.0, now_s - max(self.head_since_s, loaded))
        queue = tuple(Queued(at - now_s, tokens, p) for at, tokens, _, p in self.joining.values())
        swapping = sum(1 for at, _, swaps, _ in self.joining.values() if swaps and at > now_s)
        return Load(self.in_flight, pending, swapping, busy_s, queue)

    def candidate(self, now_s: float) -> Candidate:
        return Candidate(
            name=self.name,
            load=self.load(now_s),
            costs=self.pool.costs,
            remote_tier=None if self.pool.hbm_only else self.pool.remote_tier,
            terms=self.terms,
            pool=self.rules,
        )


_ARRIVE, _SWAPPED, _JOIN, _PREFILLED, _FINISH, _LOADED = range(6)


class Arrival(NamedTuple):
    """How one request was routed on arrival (what a parity test compares with the gateway)."""

    routed: Routed
    write: bool = False  # the remote tier's admission
    first_byte_writes: tuple[Write, ...] = ()  # left for its first byte (its load's included)


class Fleet:
    """The modelled fleet: the gateway's view of it (loads, index, reuse counts, the routing
    pipeline's state) and the engines' (caches, prefill queues). `arrive` routes one request
    at `now` (tests drive it directly to compare with the gateway); `run` replays a trace."""

    def __init__(self, setup: Setup, seed: int) -> None:
        self.setup = setup
        bs = setup.block_size_tokens
        self.bs = bs
        self.now = 0.0
        self.settings = setup.pipeline_settings()
        self.state = PipelineState(random.Random(seed))
        self.reclaimed_until_s = 0.0  # the pinned pools are not lent before then
        self.remotes = {name: RemoteTier(cap // bs) for name, cap in setup.remote_tiers.items()}
        self.replicas: list[_Replica] = []
        for pool in setup.pools:
            rules = PoolRules(
                name=pool.name,
                pinned=pool.pinned,
                hbm_only=pool.hbm_only,
                max_in_flight=pool.max_in_flight,
                max_prefill_tokens=pool.max_prefill_tokens,
                lend_below=pool.lend_below,
                engine_priority=pool.engine_priority,
            )
            remote = None
            if pool.remote_tier is not None and not pool.hbm_only:
                remote = self.remotes[pool.remote_tier]
            for i in range(pool.replicas):
                self.replicas.append(
                    _Replica(
                        name=_replica_name(pool, i),
                        pool=pool,
                        rules=rules,
                        terms=setup.terms_of(pool),
                        cache=ReplicaCache(
                            pool.hbm_capacity_tokens // bs, pool.cpu_capacity_tokens // bs
                        ),
                        remote=remote,
                    )
                )
        self.by_name = {r.name: r for r in self.replicas}
        self.pinned_exists = any(p.pinned for p in setup.pools)
        recorded = MemoryIndex(
            ttl_s=setup.index_ttl_s,
            capacity_blocks=self._capacity,
            spill_to=self._spill_to,
            clock=lambda: self.now,
        )
        self.index = SpeculativeIndex(recorded, clock=lambda: self.now)  # as gateway/wiring.py
        self.reuse = ReuseWindow(setup.reuse_window_s)
        self.events: list[tuple[float, int, int, object]] = []
        self._order = itertools.count()
        self.results: list[Replayed] = []
        self.rejected: dict[str, int] = {}
        self.shed: dict[str, int] = {}
        self.hbm_evicted = 0

    # --- the gateway's index (gateway/state.py build_index, approximate mode) ---

    def _capacity(self, loc: Location) -> int | None:
        if loc.tier is Tier.REMOTE:
            cap = self.setup.remote_tiers.get(loc.holder)
            return None if cap is None else cap // self.bs
        r = self.by_name.get(loc.holder)
        if r is None:
            return None
        tokens = r.pool.hbm_capacity_tokens if loc.tier is Tier.HBM else r.pool.cpu_capacity_tokens
        return tokens // self.bs

    def _spill_to(self, loc: Location) -> Location | None:
        r = self.by_name.get(loc.holder)
        if loc.tier is Tier.HBM and r is not None and r.pool.cpu_capacity_tokens:
            return Location(loc.holder, Tier.CPU)
        return None

    def _hits(self, model: str, hashes: Sequence[int]) -> BlockHits:
        if self.setup.mode != "precise":
            return self.index.lookup_now(model, hashes)
        hits: BlockHits = []  # precise: the engines' own caches
        for h in hashes:
            held = set()
            for r in self.replicas:
                if h in r.cache.hbm:
                    held.add(Location(r.name, Tier.HBM))
                elif r.cache.cpu is not None and h in r.cache.cpu:
                    held.add(Location(r.name, Tier.CPU))
            for name, tier in self.remotes.items():
                if h in tier.blocks:
                    held.add(Location(name, Tier.REMOTE))
            if not held:
                break
            hits.append(frozenset(held))
        return hits

    # --- events ---

    def push(self, t: float, kind: int, data: object) -> None:
        heapq.heappush(self.events, (t, kind, next(self._order), data))

    def run(self, requests: Sequence[CapturedRequest]) -> None:
        for req in requests:
            self.push(req.t_s, _ARRIVE, req)
        while self.events:
            t, kind, _, data = heapq.heappop(self.events)
            self.now = t
            if kind == _ARRIVE:
                assert isinstance(data, CapturedRequest)
                self.arrive(data)
            elif kind == _SWAPPED:
                assert isinstance(data, _Replica)
                data.swaps_in_flight -= 1
            elif kind == _JOIN:
                assert isinstance(data, _Job)
                data.joined_s = t
                heapq.heappush(data.replica.queue, (data.priority, t, data.id, data))
                self.start_next(data.replica)
            elif kind == _PREFILLED:
                assert isinstance(data, _Job)
                self.prefilled(data)
            elif kind == _LOADED:
                assert isinstance(data, _Job)
                self.record_index(data.req.model, data.loaded_writes)
                data.loaded_writes = ()
            else:
                assert isinstance(data, _Job)
                data.replica.in_flight -= 1

    def tenant_class(self, req: CapturedRequest) -> TenantClass:
        if req.tenant in self.setup.critical_tenants:
            return TenantClass.CRITICAL
        return TenantClass(req.tenant_class)

    def route(self, req: CapturedRequest, klass: TenantClass, hits: BlockHits) -> Routed:
        """The gateway's routing pipeline on the fleet as the gateway would see it now."""
        now = self.now
        fleet = FleetView(
            [r.candidate(now) for r in self.replicas],
            hits,
            now,
            pinned_pool_exists=self.pinned_exists,
            lend=now >= self.reclaimed_until_s,
        )
        request = PipelineRequest(req.hashes, req.prompt_tokens, klass, ttft_slo_ms=req.ttft_slo_ms)
        routed = route(request, fleet, self.settings, self.state, commit=True)
        reclaim_s = reclaims_lending(routed, klass, self.pinned_exists)
        if reclaim_s:
            self.reclaimed_until_s = max(self.reclaimed_until_s, now + reclaim_s)
        return routed

    def refused(self, klass: TenantClass, routed: Routed) -> bool:
        """Would the gateway answer 503 (no eligible replica, or batch traffic shed)?"""
        if routed.decision is not None and not routed.shed:
            return False
        self.rejected[klass.value] = self.rejected.get(klass.value, 0) + 1
        if routed.shed:
            self.shed[klass.value] = self.shed.get(klass.value, 0) + 1
        return True

    def admission(self, routed: Routed, req: CapturedRequest, hits: BlockHits) -> bool:
        """Does the chosen replica write the prompt to its remote tier? The family's reuse is
        counted only where a remote tier makes it matter."""
        chosen = routed.chosen
        if chosen is None or chosen.remote_tier is None:
            return False
        family = family_key(req.hashes)
        reuse = self.reuse.seen(family, self.now) if family is not None else 0
        verdict = admit(chosen, reuse, hits, req.prompt_tokens, self.settings)
        return verdict is not None and verdict.write

    def arrive(self, req: CapturedRequest) -> Arrival:
        klass = self.tenant_class(req)
        hits = self._hits(req.model, req.hashes)
        routed = self.route(req, klass, hits)
        if routed.decision is None or self.refused(klass, routed):
            return Arrival(routed)
        r = self.by_name[routed.decision.replica]
        write = self.admission(routed, req, hits)
        # the gateway's bookkeeping once the replica took it (gateway/fleet/registry.py reserve, the
        # pipeline's index-write plan)
        score = routed.decision.score()
        priority = ENGINE_PRIORITY[klass] if r.pool.engine_priority else None
        if not r.joining:
            r.head_since_s = self.now
        r.in_flight += 1
        prefill = score.overlap.prompt_tokens - score.expected_cached_tokens
        job_key = next(self._order)
        r.joining[job_key] = (
            self.now + score.estimate.load_s,
            prefill,
            score.overlap.cpu_tokens > 0,
            priority,
        )
        writes = index_writes(
            score,
            req.hashes,
            remote_tier=r.pool.remote_tier,
            write_remote=write,
            stream=req.stream,
            settings=self.settings,
        )
        job = _Job(job_key, req, klass.value, r, write=write, arrived_s=self.now)
        job.priority = priority or 0
        job.first_byte_writes = writes.at_first_byte
        if self.setup.mode != "precise":  # precise: the engines' caches are the index
            if writes.speculative is not None:
                where, hashes = writes.speculative
                ttl_s = SPECULATIVE_TTL_S + writes.loaded_after_s
                self.index.speculate(req.model, hashes, where, ttl_s)
            self.record_index(req.model, writes.at_send)
            if writes.loaded_after_s > 0.0:  # Planner.record_sent's timer
                job.loaded_writes = writes.at_loaded
                self.push(self.now + writes.loaded_after_s, _LOADED, job)
            else:
                self.record_index(req.model, writes.at_loaded)
        self._load(job)
        return Arrival(routed, write, job.loaded_writes + writes.at_first_byte)

    def _load(self, job: _Job) -> None:
        """The engine: where the request's KV is, and how long loading it takes."""
        r, req, bs = job.replica, job.req, self.bs
        reusable = req.hashes[: max(0, req.prompt_tokens - 1) // bs]
        g, c = r.cache.local_prefix(reusable)
        m = 0
        lookup_s = 0.0
        if r.remote is not None and g + c < len(reusable):
            m = r.remote.lookup(reusable[g + c :])
            lookup_s = self.setup.remote_lookup_s
        cost = estimate(
            Overlap(req.prompt_tokens, g * bs, c * bs, m * bs),
            Load(swaps_in_flight=r.swaps_in_flight),
            r.costs,
            r.terms,
        )
        fetched = m if cost.remote_fetch else 0
        if fetched and r.remote is not None:
            r.remote.read(reusable[g + c : g + c + fetched])
        if c:
            r.swaps_in_flight += 1
            self.push(self.now + lookup_s + cost.swap_s, _SWAPPED, r)
        job.reusable, job.g, job.c, job.fetched = reusable, g, c, fetched
        self.push(self.now + lookup_s + cost.load_s, _JOIN, job)

    def record_index(self, model: str, writes: Sequence[Write]) -> None:
        for where, hashes in writes:
            self.index.record_now(model, hashes[::-1], where)

    def start_next(self, r: _Replica) -> None:
        if r.busy or not r.queue:
            return
        job = heapq.heappop(r.queue)[-1]
        r.busy = True
        job.started_s = self.now
        hbm_now = r.cache.hbm.prefix_len(job.reusable)
        loaded = job.g + job.c + job.fetched
        job.hbm_blocks = job.g + max(0, hbm_now - loaded)
        cached = max(loaded, hbm_now) * self.bs
        job.computed = job.req.prompt_tokens - cached
        self.push(self.now + job.computed * r.terms.prefill_s_per_token, _PREFILLED, job)

    def prefilled(self, job: _Job) -> None:
        r, req, bs = job.replica, job.req, self.bs
        if self.setup.mode != "precise":  # its load's writes, if the estimate had them later
            self.record_index(req.model, job.loaded_writes + job.first_byte_writes)
            job.loaded_writes = ()
        placed = r.cache.place(req.hashes, job.reusable[job.g : job.g + job.c])
        self.hbm_evicted += placed.evicted_hbm
        written = 0
        if job.write and r.remote is not None:
            written = r.remote.write(req.hashes)
        r.joining.pop(job.id, None)
        r.head_since_s = self.now
        r.busy = False
        kv = r.costs.kv_bytes_per_token
        self.results.append(
            Replayed(
                arrived_s=job.arrived_s,
                tenant=req.tenant,
                tenant_class=job.tenant_class,
                pool=r.pool.name,
                replica=r.name,
                ttft_s=r.terms.fixed_s + self.now - job.arrived_s,
                queue_s=job.started_s - job.joined_s,
                prompt_tokens=req.prompt_tokens,
                hbm_tokens=job.hbm_blocks * bs,
                cpu_tokens=job.c * bs,
                remote_tokens=job.fetched * bs,
                computed_tokens=job.computed,
                pcie_bytes=job.c * bs * kv,
                fetched_bytes=job.fetched * bs * kv,
                written_bytes=written * bs * kv,
            )
        )
        self.push(self.now + decode_s(req), _FINISH, job)
        self.start_next(r)


def _replica_name(pool: PoolSetup, i: int) -> str:
    """The captured replica's name where the set-up keeps the captured pool's size, so that a
    plan names the replicas the gateway knows; a scenario's own are synthetic."""
    if len(pool.replica_names) == pool.replicas:
        return pool.replica_names[i]
    return f"{pool.name}-{i}"


def decode_s(req: CapturedRequest) -> float:
    """How long the request stayed in flight after its first token, as captured."""
    if req.e2e_s is None:
        return 0.0
    first = req.ttft_s if req.ttft_s is not None else req.est_ttft_s
    return max(0.0, req.e2e_s - first)


def replay(requests: Sequence[CapturedRequest], setup: Setup, *, seed: int = 0) -> Outcome:
    """The planned outcome of `requests` (sorted by arrival) on `setup`."""
    fleet = Fleet(setup, seed)
    fleet.run(requests)
    return Outcome(
        setup=setup,
        requests=fleet.results,
        rejected=fleet.rejected,
        shed=fleet.shed,
        remote={name: tier.stats for name, tier in fleet.remotes.items()},
        remote_resident_unread_blocks=sum(t.resident_unread() for t in fleet.remotes.values()),
        hbm_evicted_blocks=fleet.hbm_evicted,
    )
