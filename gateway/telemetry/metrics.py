"""Prometheus metrics of one gateway (a registry per app, so tests can run several apps).

The registry also carries the process's own metrics (process_*, python_info) and exposes no
`_created` series. `model` labels take only models the replicas serve (`model_label`), so client
input cannot add label values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.telemetry.heap import CollectionTimer

_PER_TOKEN = "_s_per_token"  # routing.learn.TERMS: the per-token terms' suffix
OTHER_MODEL = "other"  # the `model` label of a request for a model no replica serves (or none)


def model_label(model: object, known: Collection[str]) -> str:
    """`model` if a replica serves it, else OTHER_MODEL: label values never come from input."""
    return model if isinstance(model, str) and model in known else OTHER_MODEL


class _KeptChildren:
    """labels() with positional values, each child kept after its first lookup: prometheus_client
    validates the values, takes a lock and builds a key on every call, which made it the top entry
    of the gateway's CPU profile (docs/bench/overhead.md); a request calls labels() ~16 times."""

    _kept: dict[tuple[Any, ...], Any]

    def labels(self, *values: Any, **by_name: Any) -> Any:
        if by_name or not values:
            return super().labels(*values, **by_name)  # type: ignore[misc]
        kept = self.__dict__.setdefault("_kept", {})
        child = kept.get(values)
        if child is None:
            child = kept[values] = super().labels(*values)  # type: ignore[misc]
        return child

    def remove(self, *values: Any) -> None:
        self.__dict__.get("_kept", {}).pop(tuple(values), None)
        super().remove(*values)  # type: ignore[misc]

    def clear(self) -> None:
        self.__dict__.get("_kept", {}).clear()
        super().clear()  # type: ignore[misc]


class Counter(_KeptChildren, prometheus_client.Counter):
    pass


class Gauge(_KeptChildren, prometheus_client.Gauge):
    pass


class Histogram(_KeptChildren, prometheus_client.Histogram):
    pass


class UnsetGauge(Collector):
    """A gauge without labels that is absent from the exposition until it is first set: a
    value not known yet reads as no data on a dashboard, not as 0."""

    def __init__(self, name: str, documentation: str, *, registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self.value: float | None = None
        registry.register(self)

    def set(self, value: float) -> None:
        self.value = value

    def collect(self) -> Iterable[Metric]:
        if self.value is None:
            return []
        return [GaugeMetricFamily(self._name, self._documentation, value=self.value)]


class _NoCreatedRegistry(CollectorRegistry):
    """A registry whose exposition has no `_created` samples (prometheus_client's
    disable_created_metrics() does this process-wide; this does it for this registry alone)."""

    def collect(self) -> Iterable[Metric]:
        for family in super().collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


_DECISION_BUCKETS_S = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
)
_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# vLLM 0.32.0 vllm/v1/metrics/buckets.py INTER_TOKEN_LATENCY_BUCKETS (its
# vllm:request_time_per_output_token_seconds): 10 ms decode steps up to multi-second stalls
_TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = _NoCreatedRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.gc_pauses = CollectionTimer()  # installed by the app's lifespan (gc.callbacks)
        r.register(self.gc_pauses)
        self.requests = Counter(
            "cachelane_requests",
            "Requests by endpoint, model and final status",
            ["endpoint", "model", "status"],
            registry=r,
        )
        self.errors = Counter("cachelane_errors", "Error responses by code", ["code"], registry=r)
        self.tenant_records_rejected = Counter(
            "cachelane_tenant_records_rejected",
            "Tenant records in Redis ignored, each distinct one counted once, by reason "
            "(malformed, unsigned, bad_signature)",
            ["reason"],
            registry=r,
        )
        self.tenants_loaded = Gauge(
            "cachelane_tenants_loaded",
            "1 once the tenants in Redis were read (or no Redis); 0 before: no key is served",
            registry=r,
        )
        self.tenant_refresh_errors = Counter(
            "cachelane_tenant_refresh_errors",
            "Failed reads of the tenants in Redis, by kind (timeout, connection, auth, other)",
            ["kind"],
            registry=r,
        )
        self.decisions = Counter(
            "cachelane_decisions",
            "Routing decisions by policy, reason and replica",
            ["policy", "reason", "replica"],
            registry=r,
        )
        self.expected_cached_tokens = Counter(
            "cachelane_expected_cached_tokens",
            "Prompt tokens the chosen replica was expected to have cached",
            registry=r,
        )
        self.estimated_prompt_tokens = Counter(
            "cachelane_estimated_prompt_tokens",
            "Prompt tokens routed, as the gateway counts them (approximate; the engines' own count "
            "is cachelane_prompt_tokens)",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "cachelane_prompt_tokens",
            "Prompt tokens the engines reported in their answers' usage, by replica, tenant and "
            "model",
            ["replica", "tenant", "model"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "cachelane_cached_tokens",
            "Prompt tokens the engines reported served from their cache "
            "(usage.prompt_tokens_details.cached_tokens), by replica, tenant and model; "
            "divided by cachelane_prompt_tokens: the observed hit rate",
            ["replica", "tenant", "model"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "cachelane_decision_seconds",
            "Time to hash, look up and decide",
            buckets=_DECISION_BUCKETS_S,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "cachelane_ttft_seconds",
            "Observed time to first token, by replica, model and mode: stream (a streamed "
            "request's first byte) or whole (a request that did not stream: its response head, "
            "which comes after the whole generation)",
            ["replica", "model", "mode"],
            buckets=_TTFT_BUCKETS_S,
            registry=r,
        )
        self.e2e_seconds = Histogram(
            "cachelane_e2e_seconds",
            "Time from a request's arrival to the end of its answer (streamed: its last byte), "
            "every request, by endpoint and model",
            ["endpoint", "model"],
            buckets=_E2E_BUCKETS_S,
            registry=r,
        )
        self.replica_healthy = Gauge(
            "cachelane_replica_healthy",
            "1 if the replica passes health checks",
            ["replica"],
            registry=r,
        )
        self.replica_in_flight = Gauge(
            "cachelane_replica_in_flight",
            "Requests in flight per replica",
            ["replica"],
            registry=r,
        )
        self.ejections = Counter(
            "cachelane_replica_ejections",
            "Replicas taken out of routing, by replica and reason: connect (refused a "
            "connection), health_check (failed its checks), 5xx (answered errors in a row), "
            "timeout (no first byte in time, in a row), disconnect (connections broken, in a row)",
            ["replica", "reason"],
            registry=r,
        )
        self.readmissions = Counter(
            "cachelane_replica_readmissions",
            "Replicas taken back into routing after an ejection, by replica and the reason it "
            "was out: for connect, 5xx, timeout and disconnect only after a passing probe "
            "generation (gateway/fleet/outliers.py)",
            ["replica", "reason"],
            registry=r,
        )
        self.streams_broken = Counter(
            "cachelane_upstream_streams_broken",
            "Streamed answers that broke after their first byte (the client got an error "
            "event; no retry is possible once bytes were sent), by replica",
            ["replica"],
            registry=r,
        )
        self.client_gone = Counter(
            "cachelane_client_gone",
            "Requests whose client left before the answer began; the upstream request was "
            "cancelled",
            registry=r,
        )
        self.retries = Counter(
            "cachelane_upstream_retries",
            "Requests re-sent to another replica before the first byte, by the replica that failed",
            ["replica"],
            registry=r,
        )
        self.critical_fallbacks = Counter(
            "cachelane_critical_fallbacks",
            "Critical requests that left the pinned pool, by action (spill or reject)",
            ["action"],
            registry=r,
        )
        self.shed = Counter(
            "cachelane_shed",
            "Requests shed under overload, by class",
            ["tenant_class"],
            registry=r,
        )
        self.tenant_requests = Counter(
            "cachelane_tenant_requests",
            "Requests by tenant, class and status",
            ["tenant", "tenant_class", "status"],
            registry=r,
        )
        self.tenant_ttft_seconds = Histogram(
            "cachelane_tenant_ttft_seconds",
            "Observed time to first token of streamed requests, by tenant",
            ["tenant", "tenant_class"],
            buckets=_TTFT_BUCKETS_S,
            registry=r,
        )
        self.remote_admission = Counter(
            "cachelane_remote_admission",
            "Remote-tier write decisions (admitted or refused)",
            ["verdict"],
            registry=r,
        )
        self.remote_bytes_written = Counter(
            "cachelane_remote_bytes_admitted",
            "KV bytes the replicas were told to write to the remote tier",
            registry=r,
        )
        self.remote_bytes_avoided = Counter(
            "cachelane_remote_bytes_refused",
            "KV bytes not written to the remote tier because reuse would not pay for the write",
            registry=r,
        )
        self.estimate_ratio = Histogram(
            "cachelane_ttft_estimate_ratio",
            "Observed TTFT / estimated TTFT (streamed requests)",
            ["replica"],
            buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0),
            registry=r,
        )
        self.correction = Gauge(
            "cachelane_replica_correction_ratio",
            "Bounded correction factor on the replica's estimates (routing.calibration: "
            "correction; 1 = the cost model is right)",
            ["replica"],
            registry=r,
        )
        self.critical_routed = Counter(
            "cachelane_critical_routed",
            "Critical requests by where they went: the pinned pool, or spilled to shared pools",
            ["where"],
            registry=r,
        )
        self.pinned_share = UnsetGauge(
            "cachelane_pinned_share_ratio",
            "Share of critical requests the pinned pool took over the last report window (60 s) "
            "that had enough of them; absent until one had",
            registry=r,
        )
        self.pinned_short = Gauge(
            "cachelane_pinned_pool_short_share",
            "Share of critical requests that found the pinned pool without headroom (no pinned "
            "replica could start their prefill at once) over the last report window (60 s); "
            "above 0.2 the pool is too small for its critical demand",
            registry=r,
        )
        self.slo_attained = Counter(
            "cachelane_slo_attained",
            "Requests with a TTFT objective (x-slo-ttft-ms, or classes.*.ttft_slo_ms) by "
            "outcome: met or missed at the first byte of a streamed answer, or shed",
            ["class", "tenant", "outcome"],
            registry=r,
        )
        self.flow_waiting = Gauge(
            "cachelane_flow_waiting",
            "Requests held in the gateway's flow-control queue, by class",
            ["tenant_class"],
            registry=r,
        )
        self.flow_wait_seconds = Histogram(
            "cachelane_flow_wait_seconds",
            "Time requests waited in the gateway's flow-control queue, by class",
            ["tenant_class"],
            buckets=_TTFT_BUCKETS_S,
            registry=r,
        )
        self.flow_shed = Counter(
            "cachelane_flow_shed",
            "Requests turned away by flow control (503 with Retry-After), by class and reason",
            ["tenant_class", "reason"],
            registry=r,
        )
        self.estimate_error = Histogram(
            "cachelane_ttft_estimate_error_ratio",
            "|estimated - observed| / observed TTFT of streamed requests, per replica",
            ["replica"],
            buckets=(0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0),
            registry=r,
        )
        self.estimated_queue = Histogram(
            "cachelane_estimated_queue_seconds",
            "The queue term of the chosen replica's estimate at dispatch (compare with the "
            "engine's vllm:request_queue_time_seconds)",
            ["replica"],
            buckets=_TTFT_BUCKETS_S,
            registry=r,
        )
        self.cost_fit_seconds = Gauge(
            "cachelane_cost_fit_seconds",
            "The replica's cost terms in seconds in use (term=fixed: per request; term=step: "
            "per engine step); fitted online from observed TTFTs",
            ["replica", "term"],
            registry=r,
        )
        self.cost_fit_seconds_per_token = Gauge(
            "cachelane_cost_fit_seconds_per_token",
            "The replica's per-token cost terms in use (term: prefill, swap, fetch: seconds per "
            "prefilled, swapped-in and fetched token); fitted online from observed TTFTs",
            ["replica", "term"],
            registry=r,
        )
        self.cost_fit_samples = Gauge(
            "cachelane_cost_fit_samples",
            "Observations the replica's own cost fit has folded in (below the pooled threshold "
            "the pool's fit is used)",
            ["replica"],
            registry=r,
        )
        self.prewarms = Counter(
            "cachelane_prewarms",
            "Prewarm requests by trigger and outcome",
            ["trigger", "outcome"],
            registry=r,
        )
        self.index_errors = Counter(
            "cachelane_index_errors",
            "Index operations that failed (served on the local view)",
            ["op"],
            registry=r,
        )
        self.index_degraded = Gauge(
            "cachelane_index_degraded",
            "1 while the shared index (Redis) is unreachable and routing uses the local view",
            registry=r,
        )
        self.kv_events = Counter(
            "cachelane_kv_events",
            "KV cache events ingested from the engines (precise mode), by replica and type",
            ["replica", "type"],
            registry=r,
        )
        self.kv_events_skipped = Counter(
            "cachelane_kv_events_skipped",
            "KV events (or parts) not indexed, by replica and reason (orphan, block_size, ...)",
            ["replica", "reason"],
            registry=r,
        )
        self.kv_event_gaps = Counter(
            "cachelane_kv_event_gaps",
            "Gaps in a replica's KV event sequence",
            ["replica"],
            registry=r,
        )
        self.kv_event_replays = Counter(
            "cachelane_kv_event_replays",
            "Replay requests after a gap, by outcome (filled, incomplete, failed)",
            ["replica", "outcome"],
            registry=r,
        )
        self.kv_event_resyncs = Counter(
            "cachelane_kv_event_resyncs",
            "Times a replica's index entries were dropped to resync, by cause (gap, restart)",
            ["replica", "cause"],
            registry=r,
        )
        self.precise_fallbacks = Counter(
            "cachelane_precise_fallbacks",
            "Precise-mode requests routed without cache hits (prompt not tokenizable here)",
            ["reason"],
            registry=r,
        )
        # Cost accounting (gateway/accounting/ledger.py, routing/accounting.py): where offloading's
        # cost landed, by tenant (bounded: routing.accounting.MAX_KEYS, then "other"), class and
        # pool.
        cost_labels = ["tenant", "tenant_class", "pool"]
        self.cost_ttft_seconds = Counter(
            "cachelane_cost_ttft_seconds",
            "Observed TTFT of streamed requests attributed to each layer (fixed, queue, swap, "
            "fetch, prefill; they sum to the observed TTFT: routing/accounting.py)",
            [*cost_labels, "layer"],
            registry=r,
        )
        self.cost_tokens = Counter(
            "cachelane_cost_tokens",
            "Prompt tokens by where their KV came from (hbm, cpu, remote, computed), as the "
            "engine confirmed it",
            [*cost_labels, "tier"],
            registry=r,
        )
        self.cost_pcie_bytes = Counter(
            "cachelane_cost_pcie_bytes",
            "KV bytes swapped in from the CPU tier over PCIe",
            cost_labels,
            registry=r,
        )
        self.cost_swap_ins = Counter(
            "cachelane_cost_swap_ins",
            "Requests that swapped in from the CPU tier, by whether the PCIe link was shared "
            "with another swap-in when they were sent",
            [*cost_labels, "shared"],
            registry=r,
        )
        self.cost_remote_bytes = Counter(
            "cachelane_cost_remote_bytes",
            "Remote-tier KV bytes: written (new blocks), read (fetched), evicted (written by "
            "this row and since evicted), never_read (evicted without a read), per the "
            "gateway's model of the tier",
            [*cost_labels, "kind"],
            registry=r,
        )
        self.cost_prefill_avoided_seconds = Counter(
            "cachelane_cost_prefill_avoided_seconds",
            "Prefill GPU-seconds the cache hits in each tier avoided (tokens hit x the "
            "replica's fitted seconds per prefill token)",
            [*cost_labels, "tier"],
            registry=r,
        )
        self.cost_hbm_blocks = Counter(
            "cachelane_cost_hbm_blocks",
            "HBM blocks inserted by requests (tenant rows) and evicted (tenant and class '*': "
            "an eviction has no tenant), from the index",
            [*cost_labels, "kind"],
            registry=r,
        )
        self.discovery_resolutions = Counter(
            "cachelane_discovery_resolutions",
            "DNS resolutions of a discovered pool's name, by result (ok, failed: the replicas "
            "were kept as they were)",
            ["pool", "result"],
            registry=r,
        )
        self.replica_changes = Counter(
            "cachelane_replica_changes",
            "Replicas that joined or left a pool (discovery, reload), by change (added, removed)",
            ["pool", "change"],
            registry=r,
        )
        self.reloads = Counter(
            "cachelane_config_reloads",
            "Config reloads (SIGHUP, POST /admin/reload), by result (ok, invalid)",
            ["result"],
            registry=r,
        )
        self.rate_limited = Counter(
            "cachelane_rate_limited",
            "Requests refused with 429 by a tenant's rate limit (rate_limits), by tenant and "
            "limit (requests, tokens)",
            ["tenant", "limit"],
            registry=r,
        )
        self.auth_throttled = Counter(
            "cachelane_auth_throttled",
            "Requests refused with 429 because their client address failed authentication too "
            "often (rate_limits.failed_auth_per_min)",
            registry=r,
        )
        self.read_timeouts = Counter(
            "cachelane_read_timeouts",
            "Connections closed for sending their request too slowly, by part (headers: "
            "listen.header_timeout_s; body: listen.body_timeout_s, answered 408)",
            ["part"],
            registry=r,
        )
        self.capture_records = Counter(
            "cachelane_capture_records",
            "Requests for the traffic capture (capture.path), by outcome (written; dropped: the "
            "capture was full or its queue was)",
            ["outcome"],
            registry=r,
        )
        # What the engines generated, from the streams' own events (gateway/serving/usage.py).
        self.output_tokens = Counter(
            "cachelane_output_tokens",
            "Output tokens the engines reported in their answers' usage "
            "(usage.completion_tokens), by replica, tenant and model",
            ["replica", "tenant", "model"],
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "cachelane_time_per_output_token_seconds",
            "Streamed answers' decode pace: (last token event - first byte) / (output tokens - "
            "1), by replica and model",
            ["replica", "model"],
            buckets=_TPOT_BUCKETS_S,
            registry=r,
        )

    def set_cost_fit(self, replica: str, term: str, value: float) -> None:
        """Export one cost term (routing.learn.TERMS) in the gauge of its unit."""
        gauge, label = self._cost_fit_series(term)
        gauge.labels(replica, label).set(value)

    def _cost_fit_series(self, term: str) -> tuple[Gauge, str]:
        if term.endswith(_PER_TOKEN):
            return self.cost_fit_seconds_per_token, term.removesuffix(_PER_TOKEN)
        return self.cost_fit_seconds, term.removesuffix("_s")

    def forget_replica(self, name: str, terms: Iterable[str]) -> None:
        """Drop the gauges of a replica that left the fleet (its counters stay: a rate over
        them falls to zero)."""
        gauges = (self.replica_healthy, self.replica_in_flight, self.correction)
        series: list[tuple[Gauge, tuple[str, ...]]] = [(g, (name,)) for g in gauges]
        series += [(self.cost_fit_samples, (name,))]
        for term in terms:
            gauge, label = self._cost_fit_series(term)
            series.append((gauge, (name, label)))
        for gauge, labels in series:
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)
