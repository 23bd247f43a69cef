"""The simulated replica's KV cache and timing model, without HTTP.

One request, in order (every sleep is real and multiplied by spec.time_factor):
  1. find where the prompt's leading blocks are: g in HBM, then c more in the CPU tier, then m more
     in the remote tier (one lookup), the rest u uncached;
  2. swap the c CPU blocks in over PCIe, whose bandwidth is shared with other swap-ins in flight;
  3. fetch the m remote blocks, or recompute them if that is cheaper (they then count as uncached);
  4. prefill the uncached tail. By default (spec.engine_model "steps") as vLLM V1 does: the
     request takes its place in the replica's step loop when it arrives, is skipped while steps 2
     and 3 run, and gets token-budget chunks (steps.py, step_loop.py); its first token comes when
     the step that computes its last prompt token ends. With "serial", one request prefills at a
     time, whole, holding the replica's one slot (prefill_queue.py);
  5. put every prompt block in HBM (with "steps" when the request is first scheduled, as vLLM
     caches the blocks a step will compute; with "serial" after its prefill), demote HBM's
     overflow to the CPU tier (CPU overflow is dropped), and write the prompt's blocks to the
     remote tier unless told not to: the write runs beside the first token and the decode (a
     write costs bytes, no modelled time), and the request is not finished until it is done;
  6. decode: with "steps" one token at the end of every step (a step of decodes only lasts
     itl_s; one with prompt chunks lasts what they cost, and the decodes beside it wait for it,
     as on vLLM); with "serial" one token per itl_s, concurrently with other requests.
Steps 2 and 3 charge exactly routing.cost.estimate()'s swap and remote terms, so the gateway's cost
model and the simulator agree by construction; queueing is not modelled, it happens at step 4.

Like vLLM, the last prompt token is always computed (a full hit still prefills one token), so at
most (prompt_tokens - 1) // block_size_tokens leading blocks are reused. When its prefill starts,
HBM is looked at again: blocks another request prefilled meanwhile are reused (as vLLM's scheduler
does), and a request that loaded nothing recomputes blocks HBM lost since it arrived. Blocks
completed during decode are not cached.

With a tokenizer (precise mode) prompts are the engine's token ids, blocks are keyed like vLLM's
(token ids chained from a root that folds in the request's cache_salt), and with an event sink
every change is published as vLLM's KV events: BlockStored (medium GPU) for blocks newly in HBM,
BlockStored (medium CPU) when HBM's overflow is demoted, BlockRemoved per evicted block, and
AllBlocksCleared on reset. Engine block hashes on the wire are opaque: a per-process random seed
hashes each block's key, so a consumer must map them, as with vLLM's.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import xxhash

from gateway.engines.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    precise_namespace,
)
from gateway.engines.tokenizer import PromptTokenizer
from loadtest.sim.accounting import EngineStats, PrefillResult
from loadtest.sim.config import SimReplicaSpec
from loadtest.sim.prefill_queue import PrefillQueue
from loadtest.sim.protocol import fake_token_ids
from loadtest.sim.remote import RemoteClient
from loadtest.sim.step_loop import StepLoop
from loadtest.sim.steps import StepRequest
from loadtest.sim.tiers import BlockLRU
from routing.cost import Estimate, Load, Overlap, estimate
from routing.hashing import block_hashes, token_block_hashes
from routing.prompt import approx_tokens

EventSink = Callable[[Sequence[Event]], None]


class ContextLengthExceeded(ValueError):
    """The prompt plus the tokens to generate do not fit the model's context."""


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    prompt_tokens: int
    hashes: tuple[int, ...]  # chained hashes of every full block of the prompt
    token_ids: tuple[int, ...] = ()  # precise mode: the engine's token ids
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class _BlockInfo:
    """What an event about a held block needs (precise mode with events only)."""

    engine_hash: int
    parent: int | None  # the parent block's engine hash
    tokens: tuple[int, ...]
    salt: str | None  # cache_salt of a first block


class SimEngine:
    def __init__(
        self,
        spec: SimReplicaSpec,
        remote: RemoteClient | None,
        *,
        tokenizer: PromptTokenizer | None = None,
        events: EventSink | None = None,
    ) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.events = events
        self._blocks: dict[int, _BlockInfo] = {}  # block key -> info, while a tier holds it
        self._engine_seed = random.getrandbits(64)  # per process, like vLLM's random root hash
        bs = spec.block_size_tokens
        self.hbm = BlockLRU(spec.hbm_capacity_tokens // bs)
        self.cpu = BlockLRU(spec.cpu_capacity_tokens // bs) if spec.cpu_capacity_tokens else None
        self.remote = remote
        self.stats = EngineStats()
        self.running = 0  # requests holding or past the prefill slot
        self.waiting = 0  # requests admitted, not yet holding the prefill slot
        self.active_tokens = 0  # prompt + generated tokens of the running requests
        self._swaps_in_flight = 0
        self._prefill = PrefillQueue(spec.scheduling_policy)  # the serial engine's slot
        self.step_loop: StepLoop | None = None
        if spec.engine_model == "steps":
            self.step_loop = StepLoop(spec.step_settings(), self.sleep)

    @property
    def hbm_usage(self) -> float:
        return len(self.hbm) / self.hbm.capacity_blocks

    def prompt(self, text: str, namespace: str) -> Prompt:
        hashes = block_hashes(
            text, block_size_tokens=self.spec.block_size_tokens, namespace=namespace
        )
        # With events on and no tokenizer, the blocks carry the stand-in token ids the /render
        # endpoints return (protocol.fake_token_ids, one per CHARS_PER_TOKEN characters), so a
        # router that matches KV events by token ids (vllm-router's kv_aware) sees the sharing.
        ids = tuple(fake_token_ids(text)) if self.events is not None else ()
        return Prompt(
            text=text, prompt_tokens=approx_tokens(text), hashes=tuple(hashes), token_ids=ids
        )

    def token_prompt(self, chat: bool, body: Mapping[str, Any]) -> Prompt:
        """The prompt as the engine sees it: token ids from the tokenizer (precise mode)."""
        assert self.tokenizer is not None
        ids = self.tokenizer.chat_ids(body) if chat else self.tokenizer.completion_ids(body)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        hashes = token_block_hashes(
            ids,
            block_size_tokens=self.spec.block_size_tokens,
            namespace=precise_namespace(self.spec.model, salt),
        )
        text = self.tokenizer.render_chat(body) if chat else str(body.get("prompt"))
        return Prompt(text, len(ids), tuple(hashes), tuple(ids), salt)

    def engine_hash(self, key: int) -> int:
        return xxhash.xxh3_64_intdigest(key.to_bytes(8, "little"), seed=self._engine_seed)

    def publish_placement(
        self,
        prompt: Prompt,
        new_in_hbm: list[int],
        evicted: list[int],
        new_in_cpu: list[int],
        dropped: list[int],
    ) -> None:
        """One engine step's events, in the order the index must apply them."""
        if self.events is None or not prompt.token_ids:
            return
        bs = self.spec.block_size_tokens
        parent: int | None = None
        for i, key in enumerate(prompt.hashes):
            if key not in self._blocks:
                tokens = prompt.token_ids[i * bs : (i + 1) * bs]
                salt = prompt.cache_salt if i == 0 else None
                self._blocks[key] = _BlockInfo(self.engine_hash(key), parent, tokens, salt)
            parent = self._blocks[key].engine_hash
        out: list[Event] = []
        fresh = set(new_in_hbm)
        run: list[int] = []
        for maybe in [*prompt.hashes, None]:  # runs of consecutive new blocks, one event each
            if maybe is not None and maybe in fresh:
                run.append(maybe)
                continue
            if run:
                out.append(self._stored(run, "GPU"))
                run = []
        known = self._blocks
        out += [self._stored([k], "CPU") for k in new_in_cpu if k in known]  # copied, then freed
        out += [BlockRemoved((known[k].engine_hash,), "GPU") for k in evicted if k in known]
        out += [BlockRemoved((known[k].engine_hash,), "CPU") for k in dropped if k in known]
        for key in [*evicted, *dropped]:
            if key not in self.hbm and (self.cpu is None or key not in self.cpu):
                self._blocks.pop(key, None)
        self.events(out)

    def _stored(self, keys: list[int], medium: str) -> BlockStored:
        infos = [self._blocks[k] for k in keys]
        first = infos[0]
        extra = None if first.salt is None else ((first.salt,), *([None] * (len(keys) - 1)))
        return BlockStored(
            block_hashes=tuple(i.engine_hash for i in infos),
            parent_block_hash=first.parent,
            token_ids=tuple(t for i in infos for t in i.tokens),
            block_size=self.spec.block_size_tokens,
            medium=medium,
            extra_keys=extra,
            group_idx=0,
        )

    def check_fits(self, prompt: Prompt, max_tokens: int) -> None:
        limit = self.spec.max_model_len_tokens
        if prompt.prompt_tokens + max_tokens > limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt.prompt_tokens + max_tokens} tokens ({prompt.prompt_tokens} in the "
                f"prompt, {max_tokens} for the completion). Please reduce the length of the prompt "
                "or of the completion."
            )

    def reset_prefix_cache(self) -> None:
        """Drop every block in HBM and the CPU tier (vLLM's /reset_prefix_cache)."""
        self.hbm.clear()
        if self.cpu is not None:
            self.cpu.clear()
        self._blocks.clear()
        if self.events is not None:
            self.events([AllBlocksCleared()])

    @asynccontextmanager
    async def admit(
        self, prompt: Prompt, *, priority: int = 0, max_tokens: int | None = None
    ) -> AsyncIterator[SimRequest]:
        """One request's stay on the replica; load counts are released however it ends.
        `max_tokens`: the tokens it will be asked to decode (None: until it leaves)."""
        request = SimRequest(self, prompt, priority, max_tokens)
        self.waiting += 1
        try:
            yield request
        finally:
            if request.step_request is not None and self.step_loop is not None:
                self.step_loop.leave(request.step_request)  # its decode no longer takes budget
            if request.running:
                self.running -= 1
                self.active_tokens -= request.held_tokens
            else:
                self.waiting -= 1
            if request.remote_write is not None:
                # shielded: a client that leaves does not cancel a write under way
                await asyncio.shield(request.remote_write)

    async def sleep(self, seconds: float) -> None:
        if seconds > 0 and self.spec.time_factor > 0:
            await asyncio.sleep(seconds * self.spec.time_factor)


@dataclass(frozen=True, slots=True)
class _Located:
    """Where a prompt's reusable leading blocks are, and what loading them costs."""

    reusable: tuple[int, ...]  # the blocks that may be reused (never the last token's)
    hbm: int  # g: leading blocks in HBM
    cpu: int  # c: then in the CPU tier
    remote: int  # m: then in the remote tier
    cost: Estimate


@dataclass(slots=True)
class _Computed:
    """What the prefill reused and computed, decided when it starts (HBM is looked at again)."""

    hbm_blocks: int = 0
    cached_blocks: int = 0
    computed_tokens: int = 0


class SimRequest:
    def __init__(
        self, engine: SimEngine, prompt: Prompt, priority: int = 0, max_tokens: int | None = None
    ) -> None:
        self._engine = engine
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.priority = priority  # orders the prefill queue under scheduling_policy "priority"
        self.running = False
        self.held_tokens = 0
        self.remote_write: asyncio.Task[int] | None = None  # the prompt's write to the remote tier
        self.step_request: StepRequest | None = None  # its place in the step loop (steps model)
        self._decoded = asyncio.Semaphore(0)  # decode tokens its steps gave, not yet sent

    async def prefill(self, *, remote_write: bool = True) -> PrefillResult:
        """Load or compute the prompt's KV; returns when the first token could be sent."""
        if self._engine.step_loop is None:
            return await self._prefill_serial(remote_write)
        return await self._prefill_steps(remote_write)

    async def _prefill_serial(self, remote_write: bool) -> PrefillResult:
        """One prefill at a time, whole: the slot of prefill_queue.py."""
        eng = self._engine
        ticket = eng._prefill.ticket()  # its place in the queue: arrival, not end of its KV load
        where = await self._locate()
        sharers, fetched = await self._load(where)
        queued_at = time.monotonic()
        async with eng._prefill.slot(self.priority, ticket):
            queue_wait_s = time.monotonic() - queued_at
            self._start()
            done = self._look_again(where, fetched)
            await eng.sleep(done.computed_tokens / eng.spec.costs.prefill_tokens_per_s)
            self._place_in_hbm(swapped_in=where.reusable[where.hbm : where.hbm + where.cpu])
        return self._account(where, sharers, fetched, done, queue_wait_s, remote_write)

    async def _prefill_steps(self, remote_write: bool) -> PrefillResult:
        """vLLM V1's step loop: the request takes its place on arrival, is skipped while its KV
        loads, and has its first token when the step that computes its last prompt token ends."""
        eng = self._engine
        loop = eng.step_loop
        assert loop is not None
        first_token: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done = _Computed()
        located: list[_Located] = []
        fetched_blocks = [0]
        times = {"arrived": time.monotonic(), "located": 0.0, "loaded": 0.0, "started": 0.0}

        def resolve() -> int:
            nonlocal done
            where = located[0]
            done = self._look_again(where, fetched_blocks[0])
            # Cached as scheduled, as vLLM's allocate_slots caches the blocks a step will compute
            # (and evicts for them): a request scheduled after it, in this step or later, hits them.
            self._place_in_hbm(swapped_in=where.reusable[where.hbm : where.hbm + where.cpu])
            return done.computed_tokens

        def on_start() -> None:
            times["started"] = time.monotonic()
            self._start()

        def on_first_token() -> None:
            if not first_token.done():
                first_token.set_result(None)

        request = StepRequest(
            0,
            self.priority,
            True,
            resolve,
            on_start=on_start,
            on_first_token=on_first_token,
            on_token=self._decoded.release,
            decode_steps=None if self.max_tokens is None else max(0, self.max_tokens - 1),
        )
        self.step_request = request
        loop.submit(request)
        try:
            located.append(await self._locate())
            times["located"] = time.monotonic()
            sharers, fetched_blocks[0] = await self._load(located[0])
            times["loaded"] = time.monotonic()
            loop.loaded(request)
            await first_token
        except BaseException:
            loop.leave(request)
            raise
        queue_wait_s = times["started"] - times["loaded"]
        at = times["arrived"]
        phases = (
            times["located"] - at,
            times["loaded"] - at,
            times["started"] - at,
            time.monotonic() - at,
        )
        return self._account(
            located[0], sharers, fetched_blocks[0], done, queue_wait_s, remote_write, phases, at
        )

    async def _locate(self) -> _Located:
        eng, prompt = self._engine, self.prompt
        bs = eng.spec.block_size_tokens
        reusable = prompt.hashes[: (prompt.prompt_tokens - 1) // bs]
        g = eng.hbm.prefix_len(reusable)
        c = eng.cpu.prefix_len(reusable, g) if eng.cpu is not None else 0
        m = 0
        rest = len(reusable) - g - c
        if eng.remote is not None and rest > 0 and self._fetch_may_pay(prompt, g, c, rest):
            m = await eng.remote.lookup(list(reusable[g + c :]))
        return _Located(reusable, g, c, m, self._load_cost(prompt, g, c, m))

    def _load_cost(self, prompt: Prompt, g: int, c: int, m: int) -> Estimate:
        bs = self._engine.spec.block_size_tokens
        return estimate(
            Overlap(
                prompt.prompt_tokens, hbm_tokens=g * bs, cpu_tokens=c * bs, remote_tokens=m * bs
            ),
            Load(swaps_in_flight=self._engine._swaps_in_flight),
            self._engine.spec.costs,
        )

    def _fetch_may_pay(self, prompt: Prompt, g: int, c: int, rest: int) -> bool:
        """Would fetching all `rest` blocks beyond HBM and the CPU tier beat recomputing them?
        If not, no lookup result changes what the request does (it recomputes them), and the
        lookup is skipped: in vLLM the connector's lookup runs inside the scheduler
        (`get_num_new_matched_tokens`, vllm/v1/core/sched/scheduler.py), here it is an HTTP call
        to another process whose latency on a shared machine no engine model has (the fixed cost
        of a fetch, routing.cost.REMOTE_FIXED_S, covers the lookups that lead to one)."""
        return self._load_cost(prompt, g, c, rest).remote_fetch

    async def _load(self, where: _Located) -> tuple[int, int]:
        """Swap the CPU blocks in and fetch the remote ones (or recompute them, when cheaper);
        returns the swap-ins sharing the link (itself included, 0: none) and the blocks fetched."""
        eng = self._engine
        sharers = 0
        if where.cpu:
            sharers = eng._swaps_in_flight + 1
            eng._swaps_in_flight += 1
            try:
                await eng.sleep(where.cost.swap_s)
            finally:
                eng._swaps_in_flight -= 1
        fetched = where.remote if where.cost.remote_fetch else 0
        if fetched:
            assert eng.remote is not None
            start = where.hbm + where.cpu
            await asyncio.gather(  # the read is modelled by the sleep; the call only reports it
                eng.sleep(where.cost.remote_s),
                eng.remote.fetch(list(where.reusable[start : start + fetched])),
            )
        return sharers, fetched

    def _start(self) -> None:
        """The request's prefill starts: it counts as running from now."""
        eng = self._engine
        eng.waiting -= 1
        eng.running += 1
        self.running = True

    def _look_again(self, where: _Located, fetched: int) -> _Computed:
        """Blocks another request prefilled meanwhile are reused (as vLLM's scheduler does).

        With nothing loaded, the hits are what HBM holds now: vLLM looks its prefix cache up when
        it first schedules a request (Scheduler.schedule() calls get_computed_blocks only while
        num_computed_tokens == 0), so blocks evicted since the request arrived are computed
        again. With a load, the HBM prefix found with it stays a hit: vLLM pins it (ref count)
        when the load starts, by allocate_slots (vllm/v1/core/kv_cache_manager.py)."""
        eng = self._engine
        loaded = where.hbm + where.cpu + fetched
        hbm_now = eng.hbm.prefix_len(where.reusable)
        if loaded == where.hbm:
            bs = eng.spec.block_size_tokens
            return _Computed(hbm_now, hbm_now, self.prompt.prompt_tokens - hbm_now * bs)
        cached = max(loaded, hbm_now)
        computed = self.prompt.prompt_tokens - cached * eng.spec.block_size_tokens
        return _Computed(where.hbm + max(0, hbm_now - loaded), cached, computed)

    def _account(
        self,
        where: _Located,
        sharers: int,
        fetched: int,
        done: _Computed,
        queue_wait_s: float,
        remote_write: bool,
        phases_s: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0),
        arrived_at_s: float = 0.0,
    ) -> PrefillResult:
        eng, prompt = self._engine, self.prompt
        bs = eng.spec.block_size_tokens
        c, m = where.cpu, where.remote
        self.held_tokens = prompt.prompt_tokens
        eng.active_tokens += self.held_tokens
        s = eng.stats
        s.queue_wait_s_sum += queue_wait_s
        s.queue_wait_count += 1
        s.prompt_tokens += prompt.prompt_tokens
        s.prefix_cache_queries_tokens += prompt.prompt_tokens
        s.prefix_cache_hits_tokens += done.hbm_blocks * bs
        if eng.cpu is not None or eng.remote is not None:
            s.external_queries_tokens += prompt.prompt_tokens - done.hbm_blocks * bs
            s.external_hits_tokens += (done.cached_blocks - done.hbm_blocks) * bs
        s.swap_in_tokens += c * bs
        s.swap_ins += 1 if c else 0
        s.swap_link_sharers += sharers
        s.remote_fetch_tokens += fetched * bs
        s.remote_recompute_tokens += (m - fetched) * bs
        self.remote_write = asyncio.create_task(
            self._write_remote(known_blocks=m, enabled=remote_write)
        )
        return PrefillResult(
            prompt_tokens=prompt.prompt_tokens,
            hbm_tokens=done.hbm_blocks * bs,
            cpu_tokens=c * bs,
            remote_tokens=fetched * bs,
            computed_tokens=done.computed_tokens,
            queue_wait_s=queue_wait_s,
            swap_sharers=sharers,
            phases_s=phases_s,
            arrived_at_s=arrived_at_s,
        )

    async def decode(self, max_tokens: int) -> AsyncIterator[int]:
        """Yield token indices 0..max_tokens-1; the first right away, then one per step of the
        step loop (serial engine: one per itl_s). The step loop finishes the request with the step
        that gives its last token (max_tokens, from admit()), as vLLM does."""
        eng = self._engine
        stepped = self.step_request
        for i in range(max_tokens):
            if i:
                if stepped is None:
                    await eng.sleep(eng.spec.itl_s)
                else:
                    await self._decoded.acquire()
            self.held_tokens += 1
            eng.active_tokens += 1
            eng.stats.generation_tokens += 1
            yield i

    def _place_in_hbm(self, *, swapped_in: tuple[int, ...]) -> None:
        eng = self._engine
        new_in_hbm = [h for h in self.prompt.hashes if h not in eng.hbm]
        # Reversed, so the first block is the most recent: like vLLM, which frees a request's
        # blocks tail first, a prompt's tail is evicted before its prefix.
        evicted = eng.hbm.insert(reversed(self.prompt.hashes))
        eng.stats.hbm_evicted_blocks += len(evicted)
        new_in_cpu: list[int] = []
        dropped: list[int] = []
        if eng.cpu is not None:
            eng.cpu.touch(reversed(swapped_in))
            new_in_cpu = [h for h in evicted if h not in eng.cpu]
            dropped = eng.cpu.insert(evicted)
        eng.publish_placement(self.prompt, new_in_hbm, evicted, new_in_cpu, dropped)

    async def _write_remote(self, *, known_blocks: int, enabled: bool) -> int:
        """Offer the prompt's blocks to the remote tier; returns how many it newly stored.

        The tier skips blocks it holds (so bytes written counts only new ones); a declined write
        counts the blocks not known to be there as skipped.
        """
        eng = self._engine
        if eng.remote is None:
            return 0
        block_bytes = eng.spec.block_size_tokens * eng.spec.costs.kv_bytes_per_token
        if not enabled:
            eng.stats.remote_bytes_skipped += (len(self.prompt.hashes) - known_blocks) * block_bytes
            return 0
        written = await eng.remote.store(list(self.prompt.hashes))
        eng.stats.remote_bytes_written += written * block_bytes
        return written
