"""A routing plan: what the planner decided for one request and everything the proxy, the
settlement and the logs read from it (gateway/serving/planner.py makes it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.fleet.replica import Replica
from gateway.tenancy.tenants import Tenant
from routing.admission import AdmissionVerdict
from routing.decide import Decision
from routing.filters import Fallback
from routing.types import ENGINE_PRIORITY, BlockHits


@dataclass(frozen=True)
class Plan:
    model: str
    tenant: Tenant
    namespace: str
    cache_salt: str
    hashes: list[int]
    prompt_tokens: int
    decision: Decision
    replicas: dict[str, Replica]  # candidates by name, for the proxy's fallbacks
    fallback: Fallback | None
    admission: AdmissionVerdict | None  # None: the chosen pool has no remote tier
    reuse: int  # earlier requests of this family in the reuse window (0: not counted, see plan())
    decision_s: float
    body: dict[str, Any]
    stream: bool
    hits: BlockHits = field(repr=False, default_factory=list)  # the index lookup it was made on
    endpoint: str = "chat"  # chat, completions, responses, embeddings
    received_s: float | None = None  # perf_counter when the request reached the gateway
    ttft_objective_ms: float | None = None  # its TTFT objective (x-slo-ttft-ms or its class's)

    def in_gateway_s(self, sent_s: float) -> float:
        """How long the request was in the gateway before it was sent at `sent_s` (reading the
        body, deciding, flow control, a failed attempt): part of the client's TTFT, measured."""
        return max(0.0, sent_s - self.received_s) if self.received_s is not None else 0.0

    def engine_priority(self, replica: Replica) -> int | None:
        """The `priority` the request carries to `replica`: its class's, where the replica's pool
        schedules by priority (pools[].engine_priority) and its engine has not refused one
        (gateway/fleet/engine_priority.py); None elsewhere."""
        if not replica.rules.engine_priority:
            return None
        return ENGINE_PRIORITY[self.tenant.tenant_class]
