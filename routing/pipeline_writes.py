"""After the choice (routing/pipeline.py): the remote tier's admission, and what the index
records, where and when. Pure.

Approximate mode: a request that loads none of its prompt is recorded in HBM once the replica
accepted it. vLLM caches a block as the step that computes it is scheduled (`allocate_slots`,
vllm/v1/core/kv_cache_manager.py) and serves its waiting queue in order, looking a request's
prefix up when it first schedules it (vllm/v1/core/sched/scheduler.py): recorded in the order
they are sent, the index holds what a request routed now finds when its turn comes. A request
that loads part of its prompt from the CPU or remote tier is recorded when its load is estimated
to be done (`loaded_after_s`, the estimate's load time; at its first byte if that comes first):
vLLM caches a block that a KV transfer fills only when the transfer is done (the scheduler
allocates it with delay_cache_blocks while the request waits in WAITING_FOR_REMOTE_KVS), so a
request with the same prefix that arrives meanwhile loads it too, and its whole prompt would push
out of the index, a load's time early, blocks the engine still holds. The CPU tier's copies of the
blocks it swapped in are used then (vLLM's offloading manager touches what a request loads:
vllm/v1/kv_offload/abstract.py `touch`, an LRU in lru_manager.py). Until then the blocks it does
not load are marked speculative (routing/speculative.py): a request with the same prefix is sent
where it went.

Precise mode: the engines' KV events are the truth, so nothing is written of the replica's own:
the hit prefix is refreshed (blocks the events said are there, which this request now touches)
and the rest of the prompt is marked speculative (routing/speculative.py) until the engine's
BlockStored confirms it.

Either mode: the remote tier holds the prompt once the replica has written it, if the write was
admitted. A KV connector saves the blocks a request computes during its prefill's forward pass
(`save_kv_layer` per attention layer, `wait_for_save` as the pass ends:
vllm/distributed/kv_transfer/kv_connector/v1/base.py), so for a streamed request from its first
byte; a request elsewhere that looks for them before then finds none and recomputes the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

from routing.admission import AdmissionVerdict, should_write
from routing.decide import Candidate, Score
from routing.hidden_tier import ANY_HOLDER
from routing.types import BlockHits, Location, Tier

if TYPE_CHECKING:
    from routing.pipeline import PipelineSettings


def admit(
    chosen: Candidate,
    reuse: int,
    hits: BlockHits,
    prompt_tokens: int,
    settings: PipelineSettings,
) -> AdmissionVerdict | None:
    """Should `chosen` write the prompt to its remote tier? `reuse`: earlier requests of the
    prompt's family in the reuse window (routing/admission.py). None: no remote tier there."""
    tier = chosen.remote_tier  # None for an HBM-only pool
    if tier is None or tier == ANY_HOLDER:  # a hidden tier: the gateway does not control it
        return None
    block = settings.block_size_tokens
    remote = Location(tier, Tier.REMOTE)
    held_blocks = next((i for i, h in enumerate(hits) if remote not in h), len(hits))
    verdict = should_write(
        prompt_tokens,
        held_blocks * block,
        len(hits) * block,  # the prefix any location holds: what was shared
        reuse,
        chosen.costs,
        chosen.terms,
    )
    mode = settings.remote_write.get(chosen.pool.name, "reuse")
    if mode != "reuse":
        verdict = replace(verdict, write=mode == "always" and verdict.new_tokens > 0)
    return verdict


class Write(NamedTuple):
    """Record `hashes` (a prompt's blocks, first to last) at `where`."""

    where: Location
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class IndexWrites:
    at_send: tuple[Write, ...] = ()  # once the replica accepted the request, in this order
    # approximate mode: when its KV load is estimated to be done, `loaded_after_s` after the send
    # (0: at once), or at its first byte if that comes first
    at_loaded: tuple[Write, ...] = ()
    loaded_after_s: float = 0.0
    at_first_byte: tuple[Write, ...] = ()  # at a streamed request's first byte, after at_loaded
    # until the engine's event confirms it (precise mode) or until at_loaded (approximate mode)
    speculative: Write | None = None


def index_writes(
    score: Score,
    hashes: Sequence[int],
    *,
    remote_tier: str | None,
    write_remote: bool,
    stream: bool,
    settings: PipelineSettings,
) -> IndexWrites:
    """What the index records for a request sent to `score.replica` (the module docstring says
    why). `remote_tier`: that replica's pool's; `write_remote`: the admission's verdict."""
    block = settings.block_size_tokens
    prompt = tuple(hashes)
    hbm_at = Location(score.replica, Tier.HBM)
    remote = (
        (Write(Location(remote_tier, Tier.REMOTE), prompt),) if remote_tier and write_remote else ()
    )
    if settings.precise:
        hit_blocks = score.overlap.hbm_tokens // block
        now = (Write(hbm_at, prompt[:hit_blocks]),) if hit_blocks else ()
        speculative = Write(hbm_at, prompt[hit_blocks:])
        if stream:
            return IndexWrites(now, at_first_byte=remote, speculative=speculative)
        return IndexWrites(now + remote, speculative=speculative)
    in_hbm = (Write(hbm_at, prompt),) if prompt else ()
    swapped = score.swapped_blocks(block)
    if swapped is not None:  # its CPU copies are used first
        in_hbm = (Write(Location(score.replica, Tier.CPU), prompt[swapped]), *in_hbm)
    loaded_after_s = score.estimate.load_s
    loading = score.loaded_blocks(block)
    rest = prompt[: loading.start] + prompt[loading.stop :] if loading is not None else prompt
    marked = Write(hbm_at, rest) if rest and loaded_after_s > 0.0 else None
    if stream:
        return IndexWrites((), in_hbm, loaded_after_s, remote, marked)
    return IndexWrites(remote, in_hbm, loaded_after_s, speculative=marked)
