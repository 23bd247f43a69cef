"""Prometheus metrics of one gateway (a registry per app, so tests can run several apps).

The registry also carries the process's own metrics (process_*, python_info) and exposes no
`_created` series. `model` labels take only models the replicas serve (`model_label`), so client
input cannot add label values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable

from prometheus_client import PlatformCollector, ProcessCollector

from gateway.telemetry.families import (
    Gauge,
    NoCreatedRegistry,
    build_all,
    counter,
    gauge,
    histogram,
    unset_gauge,
)
from gateway.telemetry.heap import CollectionTimer

_PER_TOKEN = "_s_per_token"  # routing.learn.TERMS: the per-token terms' suffix
OTHER_MODEL = "other"  # the `model` label of a request for a model no replica serves (or none)


def model_label(model: object, known: Collection[str]) -> str:
    """`model` if a replica serves it, else OTHER_MODEL: label values never come from input."""
    return model if isinstance(model, str) and model in known else OTHER_MODEL


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
# Cost accounting (gateway/accounting/ledger.py, routing/accounting.py): where offloading's cost
# landed, by tenant (bounded: routing.accounting.MAX_KEYS, then "other"), class and pool.
_COST_LABELS = "tenant tenant_class pool"


class Metrics:
    """The gateway's metric families, one class attribute each (gateway/telemetry/families.py)."""

    def __init__(self) -> None:
        self.registry = NoCreatedRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.gc_pauses = CollectionTimer()  # installed by the app's lifespan (gc.callbacks)
        self.registry.register(self.gc_pauses)
        build_all(self, self.registry)

    requests = counter(
        "cachelane_requests",
        "Requests by endpoint, model and final status",
        "endpoint model status",
    )
    errors = counter("cachelane_errors", "Error responses by code", "code")
    tenant_records_rejected = counter(
        "cachelane_tenant_records_rejected",
        "Tenant records in Redis ignored, each distinct one counted once, by reason "
        "(malformed, unsigned, bad_signature)",
        "reason",
    )
    tenants_loaded = gauge(
        "cachelane_tenants_loaded",
        "1 once the tenants in Redis were read (or no Redis); 0 before: no key is served",
    )
    tenant_refresh_errors = counter(
        "cachelane_tenant_refresh_errors",
        "Failed reads of the tenants in Redis, by kind (timeout, connection, auth, other)",
        "kind",
    )
    decisions = counter(
        "cachelane_decisions",
        "Routing decisions by policy, reason and replica",
        "policy reason replica",
    )
    expected_cached_tokens = counter(
        "cachelane_expected_cached_tokens",
        "Prompt tokens the chosen replica was expected to have cached",
    )
    estimated_prompt_tokens = counter(
        "cachelane_estimated_prompt_tokens",
        "Prompt tokens routed, as the gateway counts them (approximate; the engines' own count "
        "is cachelane_prompt_tokens)",
    )
    prompt_tokens = counter(
        "cachelane_prompt_tokens",
        "Prompt tokens the engines reported in their answers' usage, by replica, tenant and model",
        "replica tenant model",
    )
    cached_tokens = counter(
        "cachelane_cached_tokens",
        "Prompt tokens the engines reported served from their cache "
        "(usage.prompt_tokens_details.cached_tokens), by replica, tenant and model; "
        "divided by cachelane_prompt_tokens: the observed hit rate",
        "replica tenant model",
    )
    decision_seconds = histogram(
        "cachelane_decision_seconds",
        "Time to hash, look up and decide",
        buckets=_DECISION_BUCKETS_S,
    )
    ttft_seconds = histogram(
        "cachelane_ttft_seconds",
        "Observed time to first token, by replica, model and mode: stream (a streamed "
        "request's first byte) or whole (a request that did not stream: its response head, "
        "which comes after the whole generation)",
        "replica model mode",
        buckets=_TTFT_BUCKETS_S,
    )
    e2e_seconds = histogram(
        "cachelane_e2e_seconds",
        "Time from a request's arrival to the end of its answer (streamed: its last byte), "
        "every request, by endpoint and model",
        "endpoint model",
        buckets=_E2E_BUCKETS_S,
    )
    replica_healthy = gauge(
        "cachelane_replica_healthy", "1 if the replica passes health checks", "replica"
    )
    replica_in_flight = gauge(
        "cachelane_replica_in_flight", "Requests in flight per replica", "replica"
    )
    ejections = counter(
        "cachelane_replica_ejections",
        "Replicas taken out of routing, by replica and reason: connect (refused a "
        "connection), health_check (failed its checks), 5xx (answered errors in a row), "
        "timeout (no first byte in time, in a row), disconnect (connections broken, in a row)",
        "replica reason",
    )
    readmissions = counter(
        "cachelane_replica_readmissions",
        "Replicas taken back into routing after an ejection, by replica and the reason it "
        "was out: for connect, 5xx, timeout and disconnect only after a passing probe "
        "generation (gateway/fleet/outliers.py)",
        "replica reason",
    )
    probes = counter(
        "cachelane_replica_probes",
        "Probe generations (max_tokens 1) sent to an ejected replica after its back-off, by "
        "replica and outcome: passed (it is taken back) or failed (out for a longer back-off)",
        "replica outcome",
    )
    streams_broken = counter(
        "cachelane_upstream_streams_broken",
        "Streamed answers that broke after their first byte (the client got an error "
        "event; no retry is possible once bytes were sent), by replica",
        "replica",
    )
    client_gone = counter(
        "cachelane_client_gone",
        "Requests whose client left before the answer began; the upstream request was cancelled",
    )
    retries = counter(
        "cachelane_upstream_retries",
        "Requests re-sent to another replica before the first byte, by the replica that failed",
        "replica",
    )
    critical_fallbacks = counter(
        "cachelane_critical_fallbacks",
        "Critical requests that left the pinned pool, by action (spill or reject)",
        "action",
    )
    shed = counter("cachelane_shed", "Requests shed under overload, by class", "tenant_class")
    tenant_requests = counter(
        "cachelane_tenant_requests",
        "Requests by tenant, class and status",
        "tenant tenant_class status",
    )
    tenant_ttft_seconds = histogram(
        "cachelane_tenant_ttft_seconds",
        "Observed time to first token of streamed requests, by tenant",
        "tenant tenant_class",
        buckets=_TTFT_BUCKETS_S,
    )
    remote_admission = counter(
        "cachelane_remote_admission", "Remote-tier write decisions (admitted or refused)", "verdict"
    )
    remote_bytes_written = counter(
        "cachelane_remote_bytes_admitted",
        "KV bytes the replicas were told to write to the remote tier",
    )
    remote_bytes_avoided = counter(
        "cachelane_remote_bytes_refused",
        "KV bytes not written to the remote tier because reuse would not pay for the write",
    )
    estimate_ratio = histogram(
        "cachelane_ttft_estimate_ratio",
        "Observed TTFT / estimated TTFT (streamed requests)",
        "replica",
        buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0),
    )
    correction = gauge(
        "cachelane_replica_correction_ratio",
        "Bounded correction factor on the replica's estimates (routing.calibration: "
        "correction; 1 = the cost model is right)",
        "replica",
    )
    critical_routed = counter(
        "cachelane_critical_routed",
        "Critical requests by where they went: the pinned pool, or spilled to shared pools",
        "where",
    )
    pinned_share = unset_gauge(
        "cachelane_pinned_share_ratio",
        "Share of critical requests the pinned pool took over the last report window (60 s) "
        "that had enough of them; absent until one had",
    )
    pinned_short = gauge(
        "cachelane_pinned_pool_short_ratio",
        "Share of critical requests the pinned pool was short for (a pinned replica without "
        "headroom would have taken them with an empty queue) over the last report window (60 s); "
        "above 0.2 the pool is too small for its critical demand",
    )
    slo_attained = counter(
        "cachelane_slo_attained",
        "Requests with a TTFT objective (x-slo-ttft-ms, or classes.*.ttft_slo_ms) by "
        "outcome: met or missed at the first byte of a streamed answer, or shed",
        "class tenant outcome",
    )
    flow_waiting = gauge(
        "cachelane_flow_waiting",
        "Requests held in the gateway's flow-control queue, by class",
        "tenant_class",
    )
    flow_wait_seconds = histogram(
        "cachelane_flow_wait_seconds",
        "Time requests waited in the gateway's flow-control queue, by class",
        "tenant_class",
        buckets=_TTFT_BUCKETS_S,
    )
    flow_shed = counter(
        "cachelane_flow_shed",
        "Requests turned away by flow control (503 with Retry-After), by class and reason",
        "tenant_class reason",
    )
    estimate_error = histogram(
        "cachelane_ttft_estimate_error_ratio",
        "|estimated - observed| / observed TTFT of streamed requests, per replica",
        "replica",
        buckets=(0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0),
    )
    estimate_miss = gauge(
        "cachelane_estimate_miss_ratio",
        "The replica's typical recent estimate miss (exp of the mean |ln(observed/estimated)|, "
        "minus 1; starts at 2: a 3x miss), routing/authority.py",
        "replica",
    )
    estimate_robust_share = gauge(
        "cachelane_estimate_robust_share_ratio",
        "How much the replica's routing cost leans on the robust cost instead of the estimate "
        "(0: the estimate alone; 1: the robust cost alone), routing/authority.py",
        "replica",
    )
    estimated_queue = histogram(
        "cachelane_estimated_queue_seconds",
        "The queue term of the chosen replica's estimate at dispatch (compare with the "
        "engine's vllm:request_queue_time_seconds)",
        "replica",
        buckets=_TTFT_BUCKETS_S,
    )
    cost_fit_seconds = gauge(
        "cachelane_cost_fit_seconds",
        "The replica's cost terms in seconds in use (term=fixed: per request; term=step: "
        "per engine step); fitted online from observed TTFTs",
        "replica term",
    )
    cost_fit_seconds_per_token = gauge(
        "cachelane_cost_fit_seconds_per_token",
        "The replica's per-token cost terms in use (term: prefill, swap, fetch: seconds per "
        "prefilled, swapped-in and fetched token); fitted online from observed TTFTs",
        "replica term",
    )
    cost_fit_samples = gauge(
        "cachelane_cost_fit_samples",
        "Observations the replica's own cost fit has folded in (below the pooled threshold "
        "the pool's fit is used)",
        "replica",
    )
    prewarms = counter(
        "cachelane_prewarms", "Prewarm requests by trigger and outcome", "trigger outcome"
    )
    index_errors = counter(
        "cachelane_index_errors", "Index operations that failed (served on the local view)", "op"
    )
    index_degraded = gauge(
        "cachelane_index_degraded",
        "1 while the shared index (Redis) is unreachable and routing uses the local view",
    )
    kv_events = counter(
        "cachelane_kv_events",
        "KV cache events ingested from the engines (precise mode), by replica and type",
        "replica type",
    )
    kv_events_skipped = counter(
        "cachelane_kv_events_skipped",
        "KV events (or parts) not indexed, by replica and reason (orphan, block_size, ...)",
        "replica reason",
    )
    kv_event_gaps = counter(
        "cachelane_kv_event_gaps", "Gaps in a replica's KV event sequence", "replica"
    )
    kv_event_replays = counter(
        "cachelane_kv_event_replays",
        "Replay requests after a gap, by outcome (filled, incomplete, failed)",
        "replica outcome",
    )
    kv_event_resyncs = counter(
        "cachelane_kv_event_resyncs",
        "Times a replica's index entries were dropped to resync, by cause (gap, restart)",
        "replica cause",
    )
    precise_fallbacks = counter(
        "cachelane_precise_fallbacks",
        "Precise-mode requests routed without cache hits (prompt not tokenizable here)",
        "reason",
    )
    cost_ttft_seconds = counter(
        "cachelane_cost_ttft_seconds",
        "Observed TTFT of streamed requests attributed to each layer (fixed, queue, swap, "
        "fetch, prefill; they sum to the observed TTFT: routing/accounting.py)",
        f"{_COST_LABELS} layer",
    )
    cost_tokens = counter(
        "cachelane_cost_tokens",
        "Prompt tokens by where their KV came from (hbm, cpu, remote, computed), as the "
        "engine confirmed it",
        f"{_COST_LABELS} tier",
    )
    cost_pcie_bytes = counter(
        "cachelane_cost_pcie_bytes", "KV bytes swapped in from the CPU tier over PCIe", _COST_LABELS
    )
    cost_swap_ins = counter(
        "cachelane_cost_swap_ins",
        "Requests that swapped in from the CPU tier, by whether the PCIe link was shared "
        "with another swap-in when they were sent",
        f"{_COST_LABELS} shared",
    )
    cost_remote_bytes = counter(
        "cachelane_cost_remote_bytes",
        "Remote-tier KV bytes: written (new blocks), read (fetched), evicted (written by "
        "this row and since evicted), never_read (evicted without a read), per the "
        "gateway's model of the tier",
        f"{_COST_LABELS} kind",
    )
    cost_prefill_avoided_seconds = counter(
        "cachelane_cost_prefill_avoided_seconds",
        "Prefill GPU-seconds the cache hits in each tier avoided (tokens hit x the "
        "replica's fitted seconds per prefill token)",
        f"{_COST_LABELS} tier",
    )
    cost_hbm_blocks = counter(
        "cachelane_cost_hbm_blocks",
        "HBM blocks inserted by requests (tenant rows) and evicted (tenant and class '*': "
        "an eviction has no tenant), from the index",
        f"{_COST_LABELS} kind",
    )
    discovery_resolutions = counter(
        "cachelane_discovery_resolutions",
        "DNS resolutions of a discovered pool's name, by result (ok, failed: the replicas "
        "were kept as they were)",
        "pool result",
    )
    replica_changes = counter(
        "cachelane_replica_changes",
        "Replicas that joined or left a pool (discovery, reload), by change (added, removed)",
        "pool change",
    )
    reloads = counter(
        "cachelane_config_reloads",
        "Config reloads (SIGHUP, POST /admin/reload), by result (ok, invalid)",
        "result",
    )
    rate_limited = counter(
        "cachelane_rate_limited",
        "Requests refused with 429 by a tenant's rate limit (rate_limits), by tenant and "
        "limit (requests, tokens)",
        "tenant limit",
    )
    auth_throttled = counter(
        "cachelane_auth_throttled",
        "Requests refused with 429 because their client address failed authentication too "
        "often (rate_limits.failed_auth_per_min)",
    )
    read_timeouts = counter(
        "cachelane_read_timeouts",
        "Connections closed for sending their request too slowly, by part (headers: "
        "listen.header_timeout_s; body: listen.body_timeout_s, answered 408)",
        "part",
    )
    capture_records = counter(
        "cachelane_capture_records",
        "Requests for the traffic capture (capture.path), by outcome (written; dropped: the "
        "capture was full or its queue was)",
        "outcome",
    )
    # What the engines generated, from the streams' own events (gateway/serving/usage.py).
    output_tokens = counter(
        "cachelane_output_tokens",
        "Output tokens the engines reported in their answers' usage "
        "(usage.completion_tokens), by replica, tenant and model",
        "replica tenant model",
    )
    time_per_output_token = histogram(
        "cachelane_time_per_output_token_seconds",
        "Streamed answers' decode pace: (last token event - first byte) / (output tokens - "
        "1), by replica and model",
        "replica model",
        buckets=_TPOT_BUCKETS_S,
    )

    def count_probe(self, replica: str, passed: bool) -> None:
        self.probes.labels(replica, "passed" if passed else "failed").inc()

    def set_cost_fit(self, replica: str, term: str, value: float) -> None:
        """Export one cost term (routing.learn.TERMS) in the gauge of its unit."""
        family, label = self._cost_fit_series(term)
        family.labels(replica, label).set(value)

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
            family, label = self._cost_fit_series(term)
            series.append((family, (name, label)))
        for family, labels in series:
            with contextlib.suppress(KeyError):
                family.remove(*labels)
