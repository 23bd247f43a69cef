"""What a request's class buys: critical pinning, per-class TTFT objectives, flow control, overload
shedding and prewarming."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from gateway.config.base import NonNegativeInt, PositiveFloat, PositiveInt, Strict
from routing.filters import Fallback


class CriticalConfig(Strict):
    fallback: Fallback = Fallback.SPILL  # when the pinned pool is down or over its cap
    retry_after_s: PositiveInt = 1
    placement: Literal["pinned_first", "cost"] = Field(
        default="cost",
        description="`cost` (the default with `fallback: spill`): every pinned and shared "
        "replica is a candidate and the cost model picks; within 25% of the best cost "
        "(routing/pipeline.py CLOSE_COST) a replica with a tier below HBM is preferred to an "
        "HBM-only one, and a pinned one of those with headroom to a shared one, so a "
        "follow-up goes where its context is, in whichever pool; the admission cap then only "
        "governs lending. `pinned_first` (the default with `fallback: reject`): critical "
        "requests use the pinned replicas under their admission cap, and the shared pools only "
        "when none is (or, with `classes.critical.ttft_budget_ms`, when the pinned estimate is "
        "over it).",
    )
    clear_while_loading: bool = Field(
        default=False,
        description="While a critical request loads its KV (CPU swap-in, remote fetch) before it "
        "joins its replica's prefill queue, standard and batch requests that would start "
        "their prefill there first go to another candidate: a started prefill is not "
        "interrupted, even by engine priority, so it would be the critical request's wait.",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_placement(cls, data: Any) -> Any:
        """No placement given: `cost`, but with `fallback: reject` the pinned pool is a wall,
        not a preference: `pinned_first`."""
        if isinstance(data, dict) and "placement" not in data:
            reject = str(data.get("fallback", Fallback.SPILL.value)) == Fallback.REJECT.value
            return {**data, "placement": "pinned_first" if reject else "cost"}
        return data

    @model_validator(mode="after")
    def _cost_needs_spill(self) -> CriticalConfig:
        if self.placement == "cost" and self.fallback is not Fallback.SPILL:
            raise ValueError("critical.placement: cost needs critical.fallback: spill")
        return self


MAX_TTFT_SLO_MS = 600_000.0
# 10 minutes: past any first-byte timeout a pool may have (pools[].first_byte_timeout_s), so a
# larger objective can only be a unit mistake (seconds given as ms, or a timestamp).


class ClassConfig(Strict):
    """Flow control for one tenant class (gateway/serving/flow.py)."""

    ttft_budget_ms: PositiveFloat | None = Field(
        default=None,
        description="Dispatch a request while some eligible replica's estimated TTFT is within "
        "this budget (or its prefill queue is empty); otherwise hold it in the gateway, in its "
        "class's queue, until one is. Unset: never held.",
    )
    max_wait_s: PositiveFloat = Field(
        default=30.0,
        description="Longest a request waits in the gateway's queue; then 503 with Retry-After.",
    )
    max_queue: NonNegativeInt = Field(
        default=1024,
        description="Requests of the class the gateway holds at most; past it, 503 at once.",
    )
    ttft_slo_ms: Annotated[float, Field(gt=0, le=MAX_TTFT_SLO_MS)] | None = Field(
        default=None,
        description="The class's TTFT objective, for requests that state none (header "
        "`x-slo-ttft-ms`): each is placed where its estimate meets it with the least harm to "
        "others, a batch request that cannot be is shed (503 with Retry-After), and "
        "attainment is counted (cachelane_slo_attained_total). Unset: no objective.",
    )


class ClassesConfig(Strict):
    """Per-class flow control; classes are served critical first, then standard, then batch,
    round robin between the tenants of a class."""

    critical: ClassConfig = ClassConfig(max_wait_s=10.0)
    standard: ClassConfig = ClassConfig(ttft_budget_ms=1000.0, max_wait_s=30.0)
    # 1 s of estimated TTFT: enough queued prefill to keep an engine's batches full (a busy 8B
    # replica prefills ~30k tokens in that time, routing/cost.py), short enough that a critical
    # request dispatched past the held ones waits for little.
    batch: ClassConfig = ClassConfig(ttft_budget_ms=500.0, max_wait_s=60.0)
    # batch holds back sooner than standard, so standard is dispatched first under load.


class FlowControlConfig(Strict):
    enabled: bool = Field(
        default=True,
        description="Hold requests in per-class queues in the gateway when every replica's "
        "estimated TTFT is over the class's budget (classes.*), instead of piling them onto "
        "the engines' queues.",
    )


class PrewarmConfig(Strict):
    enabled: bool = False
    hot_after: PositiveInt = 3  # requests of a prefix family in the reuse window before it is hot
    max_per_s: PositiveFloat = 2.0  # warms sent per second by one gateway
    budget_tokens_per_min: PositiveInt = 1_000_000
    # 1M prompt tokens/min = ~0.55 s of prefill per second at 30k tokens/s: at most about half a
    # GPU's prefill time goes to warming, across the whole fleet, per gateway.
    method: Literal["completion", "prefetch"] = "completion"  # prefetch: the simulator's call
    queue_size: PositiveInt = 64
    timeout_s: PositiveFloat = 30.0


class OverloadConfig(Strict):
    batch_max_queue_s: PositiveFloat = 5.0  # batch is shed when its best queue is longer
