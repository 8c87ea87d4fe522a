"""Prometheus metrics of the control plane, in a registry of its own.

A private registry keeps two control planes in one process (tests) from colliding, and keeps
the exposition to what an operator of this service needs.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class ServiceMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "specserve_requests", "Requests finished, by finish reason", ["reason"], registry=r
        )
        self.rejected = Counter(
            "specserve_requests_rejected", "Requests refused before they started", registry=r
        )
        self.resumed = Counter(
            "specserve_requests_resumed",
            "Requests moved to another worker after theirs failed, or resumed by their client "
            "after its control plane went away",
            registry=r,
        )
        self.forwarded = Counter(
            "specserve_requests_forwarded",
            "Requests sent on to another control plane whose worker held more of their prefix",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "specserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generated_tokens = Counter(
            "specserve_generated_tokens", "Tokens generated and delivered", registry=r
        )
        self.ttft = Histogram(
            "specserve_time_to_first_token_seconds",
            "From arrival to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "specserve_inter_token_latency_seconds",
            "Between consecutive generated tokens of a request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "specserve_queue_depth", "Requests waiting, per worker", ["worker"], registry=r
        )
        self.running = Gauge(
            "specserve_running_requests", "Requests running, per worker", ["worker"], registry=r
        )
        self.kv_usage = Gauge(
            "specserve_kv_usage", "Fraction of KV blocks in use, per worker", ["worker"], registry=r
        )
        self.prefix_query_tokens = Counter(
            "specserve_prefix_query_tokens", "Prompt tokens looked up for routing", registry=r
        )
        self.prefix_hit_tokens = Counter(
            "specserve_prefix_hit_tokens",
            "Prompt tokens cached on the worker a request was routed to",
            registry=r,
        )
        self.acceptance_length = Histogram(
            "specserve_acceptance_length",
            "Mean tokens per draft round of each finished speculative request",
            buckets=(1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0),
            registry=r,
        )
        self.index_lookup = Histogram(
            "specserve_index_lookup_seconds",
            "Prefix-index lookups against Redis",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.index_errors = Counter(
            "specserve_index_errors", "Redis operations that failed", ["op"], registry=r
        )
        self.step_gap = Histogram(
            "specserve_step_turnaround_seconds",
            "From a worker's step result arriving to its next step batch leaving",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.worker_up = Gauge(
            "specserve_worker_up", "1 while a worker is registered", ["worker"], registry=r
        )
        self.workers = Gauge("specserve_workers", "Live workers", registry=r)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Expose /metrics over HTTP on `port` (in a daemon thread)."""
        start_http_server(port, addr=addr, registry=self.registry)

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample's current value (tests and benchmarks read metrics through this)."""
        return self.registry.get_sample_value(name, labels or {})
