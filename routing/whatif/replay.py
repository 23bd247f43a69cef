"""Replay a capture on a set-up: a discrete-event model of the fleet. Pure and deterministic for
a seed (the only randomness is routing's tie-break generator).

Each captured request arrives at its captured time and is routed as the gateway routes it: the
candidates' loads as the gateway's registry keeps them (requests sent and not past their first
token, each with its estimated join time; the head's progress), the gateway's own index of where
prompts went (approximate mode: routing/index.py's MemoryIndex with the HBM capacity spilling to
the CPU tier; precise mode: the engines' caches as they are), the pool filters by tenant class
(routing/filters.py) and decide() with the configured policy (routing/decide.py), then remote
admission (routing/admission.py) on the family's reuse count. So a planned routing is the
gateway's routing on the same inputs.

On the chosen replica the request then runs as a replica runs it (loadtest/sim/engine.py models
the same steps for a vLLM-like engine):

  1. its prompt's blocks are looked up in the replica's HBM, CPU tier and remote tier
     (routing/whatif/cache.py);
     (the lookup takes the set-up's `remote_lookup_s`, which the cost model has no term for);
  2. CPU blocks are swapped in (PCIe shared with the swap-ins in flight) and remote blocks
     fetched, or recomputed when that is cheaper: routing/cost.py's swap and remote terms at the
     pool's cost terms;
  3. it joins the replica's prefill queue, one prefill at a time in join order (a discrete-event
     queue per replica): what it waits there is the TTFT's queueing term;
  4. when it starts, HBM is looked at again (blocks another request prefilled meanwhile are
     reused), and it prefills the rest at the fitted seconds per prefill token;
  5. its blocks are placed (HBM, demotion to CPU) and, if admitted, written to the remote tier;
     its first token goes out; it then decodes for as long as it did in the capture.

TTFT = the fitted fixed overhead + the time from arrival to the end of its prefill.

Not modelled: decode steps sharing the prefill's steps (the fitted prefill rate absorbs their
average on a real engine), the gateway's flow control (requests are sent at once), requests
sent by other gateways, engine preemption.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from routing.admission import AdmissionVerdict, ReuseWindow, family_key, should_write
from routing.cost import CostTerms, Load, Overlap, PoolCosts, Queued, estimate
from routing.decide import Candidate, Decision, Policy, PoolRules, RouteRequest, decide
from routing.filters import Fallback, eligible
from routing.index import MemoryIndex
from routing.types import BlockHits, Location, TenantClass, Tier
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
    rejected: dict[str, int]  # class -> requests no replica could take
    remote: dict[str, RemoteStats]
    remote_resident_unread_blocks: int
    hbm_evicted_blocks: int


@dataclass
class _Job:
    id: int
    req: CapturedRequest
    tenant_class: str
    replica: _Replica
    reusable: tuple[int, ...]
    g: int
    c: int
    fetched: int
    write: bool
    arrived_s: float
    joined_s: float = 0.0
    started_s: float = 0.0
    hbm_blocks: int = 0
    computed: int = 0
    indexed_at_first_byte: bool = False  # its loaded blocks enter the index at its first byte


@dataclass
class _Replica:
    name: str
    pool: PoolSetup
    rules: PoolRules
    terms: CostTerms
    cache: ReplicaCache
    remote: RemoteTier | None
    # the engine
    queue: list[tuple[float, int, _Job]] = field(default_factory=list)
    busy: bool = False
    swaps_in_flight: int = 0
    # the gateway's view (gateway/registry.py: Replica.load, Registry.reserve)
    in_flight: int = 0
    joining: dict[int, tuple[float, int, bool]] = field(default_factory=dict)
    head_since_s: float = 0.0

    @property
    def costs(self) -> PoolCosts:
        return self.pool.costs

    def load(self, now_s: float) -> Load:
        pending = sum(tokens for _, tokens, _ in self.joining.values())
        busy_s = 0.0
        if self.joining:
            loaded = min(at for at, _, _ in self.joining.values())
            busy_s = max(0.0, now_s - max(self.head_since_s, loaded))
        queue = tuple(Queued(at - now_s, tokens) for at, tokens, _ in self.joining.values())
        swapping = sum(1 for at, _, swaps in self.joining.values() if swaps and at > now_s)
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


_ARRIVE, _SWAPPED, _JOIN, _PREFILLED, _FINISH = range(5)


class _Fleet:
    def __init__(self, setup: Setup, seed: int) -> None:
        self.setup = setup
        bs = setup.block_size_tokens
        self.bs = bs
        self.now = 0.0
        self.rng = random.Random(seed)
        self.seq = 0
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
            )
            remote = None
            if pool.remote_tier is not None and not pool.hbm_only:
                remote = self.remotes[pool.remote_tier]
            for i in range(pool.replicas):
                self.replicas.append(
                    _Replica(
                        name=f"{pool.name}-{i}",
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
        self.index = MemoryIndex(
            ttl_s=setup.index_ttl_s,
            capacity_blocks=self._capacity,
            spill_to=self._spill_to,
            clock=lambda: self.now,
        )
        self.reuse = ReuseWindow(setup.reuse_window_s)
        self.events: list[tuple[float, int, int, object]] = []
        self._order = itertools.count()
        self.results: list[Replayed] = []
        self.rejected: dict[str, int] = {}
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
                heapq.heappush(data.replica.queue, (t, data.id, data))
                self.start_next(data.replica)
            elif kind == _PREFILLED:
                assert isinstance(data, _Job)
                self.prefilled(data)
            else:
                assert isinstance(data, _Job)
                data.replica.in_flight -= 1

    def tenant_class(self, req: CapturedRequest) -> TenantClass:
        if req.tenant in self.setup.critical_tenants:
            return TenantClass.CRITICAL
        return TenantClass(req.tenant_class)

    def route(self, req: CapturedRequest, klass: TenantClass, hits: BlockHits) -> Decision | None:
        """The gateway's choice (gateway/planner.py Planner._route: filters, decide, the spill
        of a critical request over its budget)."""
        now = self.now
        allowed = eligible(
            [r.candidate(now) for r in self.replicas],
            klass,
            Fallback(self.setup.critical_fallback),
            pinned_pool_exists=self.pinned_exists,
        )
        if not allowed.candidates:
            return None
        request = RouteRequest(req.hashes, req.prompt_tokens, self.bs)
        policy = Policy(self.setup.policy)
        decision = decide(request, allowed.candidates, hits, policy, seq=self.seq, rng=self.rng)
        budget = self.setup.critical_budget_ms
        if allowed.overflow and budget is not None and decision.est_ttft_s * 1000 > budget:
            decision = decide(
                request,
                allowed.candidates + allowed.overflow,
                hits,
                policy,
                seq=self.seq,
                rng=self.rng,
            )
        self.seq += 1
        return decision

    def admission(
        self, r: _Replica, req: CapturedRequest, hits: BlockHits
    ) -> AdmissionVerdict | None:
        """gateway/planner.py Planner._admission."""
        tier = r.pool.remote_tier
        if tier is None or r.pool.hbm_only:
            return None
        family = family_key(req.hashes)
        reuse = self.reuse.seen(family, self.now) if family is not None else 0
        remote = Location(tier, Tier.REMOTE)
        held = next((i for i, h in enumerate(hits) if remote not in h), len(hits))
        verdict = should_write(
            req.prompt_tokens, held * self.bs, len(hits) * self.bs, reuse, r.costs, r.terms
        )
        if r.pool.remote_write != "reuse":
            always = r.pool.remote_write == "always" and verdict.new_tokens > 0
            verdict = AdmissionVerdict(
                always, verdict.expected_reuse, verdict.gain_s, verdict.cost_s, verdict.new_tokens
            )
        return verdict

    def arrive(self, req: CapturedRequest) -> None:
        klass = self.tenant_class(req)
        hits = self._hits(req.model, req.hashes)
        decision = self.route(req, klass, hits)
        if decision is None:
            self.rejected[klass.value] = self.rejected.get(klass.value, 0) + 1
            return
        r = self.by_name[decision.replica]
        verdict = self.admission(r, req, hits)
        write = verdict is not None and verdict.write
        # the gateway's bookkeeping once the replica took it (gateway/proxy.py _reserve,
        # Planner.record_sent)
        score = decision.score()
        if not r.joining:
            r.head_since_s = self.now
        r.in_flight += 1
        prefill = score.overlap.prompt_tokens - score.expected_cached_tokens
        job_key = next(self._order)
        r.joining[job_key] = (
            self.now + score.estimate.load_s,
            prefill,
            score.overlap.cpu_tokens > 0,
        )
        # (Planner.record_sent: a streamed request's loaded blocks, and the prompt a write puts
        # in the remote tier, from its first byte: `prefilled`)
        loading = None
        if self.setup.mode != "precise":
            loading = score.loaded_blocks(self.bs) if req.stream else None
            hbm = req.hashes
            if loading is not None:
                hbm = req.hashes[: loading.start] + req.hashes[loading.stop :]
            self.index.record_now(req.model, hbm[::-1], Location(r.name, Tier.HBM))
            if write and not req.stream:
                self._record_remote(r, req)
        # the engine: where its KV is, and how long loading it takes
        bs = self.bs
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
        job = _Job(
            job_key,
            req,
            klass.value,
            r,
            reusable,
            g,
            c,
            fetched,
            write,
            arrived_s=self.now,
            indexed_at_first_byte=loading is not None,
        )
        self.push(self.now + lookup_s + cost.load_s, _JOIN, job)

    def _record_remote(self, r: _Replica, req: CapturedRequest) -> None:
        if r.pool.remote_tier is not None:
            where = Location(r.pool.remote_tier, Tier.REMOTE)
            self.index.record_now(req.model, req.hashes[::-1], where)

    def start_next(self, r: _Replica) -> None:
        if r.busy or not r.queue:
            return
        _, _, job = heapq.heappop(r.queue)
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
        if self.setup.mode != "precise" and req.stream:  # Planner.record_loaded
            if job.indexed_at_first_byte:
                self.index.record_now(req.model, req.hashes[::-1], Location(r.name, Tier.HBM))
            if job.write:
                self._record_remote(r, req)
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


def decode_s(req: CapturedRequest) -> float:
    """How long the request stayed in flight after its first token, as captured."""
    if req.e2e_s is None:
        return 0.0
    first = req.ttft_s if req.ttft_s is not None else req.est_ttft_s
    return max(0.0, req.e2e_s - first)


def replay(requests: Sequence[CapturedRequest], setup: Setup, *, seed: int = 0) -> Outcome:
    """The planned outcome of `requests` (sorted by arrival) on `setup`."""
    fleet = _Fleet(setup, seed)
    fleet.run(requests)
    return Outcome(
        setup=setup,
        requests=fleet.results,
        rejected=fleet.rejected,
        remote={name: tier.stats for name, tier in fleet.remotes.items()},
        remote_resident_unread_blocks=sum(t.resident_unread() for t in fleet.remotes.values()),
        hbm_evicted_blocks=fleet.hbm_evicted,
    )
