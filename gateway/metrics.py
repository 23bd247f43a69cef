"""Prometheus metrics of one gateway (a registry per app, so tests can run several apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "cachelane_requests",
            "Requests by endpoint and final status",
            ["endpoint", "status"],
            registry=r,
        )
        self.errors = Counter("cachelane_errors", "Error responses by code", ["code"], registry=r)
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
        self.prompt_tokens = Counter(
            "cachelane_prompt_tokens", "Prompt tokens routed (approximate)", registry=r
        )
        self.decision_seconds = Histogram(
            "cachelane_decision_seconds",
            "Time to hash, look up and decide",
            buckets=_DECISION_BUCKETS_S,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "cachelane_ttft_seconds",
            "Observed time to first byte from the replica",
            ["replica"],
            buckets=_TTFT_BUCKETS_S,
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
        self.retries = Counter(
            "cachelane_upstream_retries",
            "Requests re-sent to another replica before the first byte, by the replica that failed",
            ["replica"],
            registry=r,
        )
        self.index_errors = Counter(
            "cachelane_index_errors",
            "Index operations that failed (served on the local view)",
            ["op"],
            registry=r,
        )
