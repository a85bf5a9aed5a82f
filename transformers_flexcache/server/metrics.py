"""The server's Prometheus metrics (`GET /metrics`).

The engine's gauges and counters are read when scraped (a collector over `Engine`'s public properties and
`stats`), so they are never stale; what only the server sees (tokens it answered with, latencies, HTTP outcomes) is
counted as requests end. Each server has a registry of its own, so that several servers in one process (tests)
do not share metrics.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EngineCollector:
    """The engine's state at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []  # no metric is checked at registration: they are all read at scrape time

    def collect(self):
        engine = self.engine
        gauges = {
            "flexcache_requests_queued": ("requests waiting for seats", engine.num_queued),
            "flexcache_requests_running": ("requests holding seats", engine.num_running),
            "flexcache_seats_in_use": ("cache rows held by running requests", engine.seats_in_use),
            "flexcache_seats": ("cache rows of the engine (max_batch_size)", engine.max_batch_size),
        }
        for name, (documentation, value) in gauges.items():
            yield GaugeMetricFamily(name, documentation, value=value)
        stats = dict(engine.stats)
        outcomes = CounterMetricFamily(
            "flexcache_engine_requests", "requests the engine ended, by outcome", labels=["outcome"]
        )
        for outcome in ("finished", "failed", "cancelled"):
            outcomes.add_metric([outcome], stats.get(outcome, 0))
        yield outcomes
        yield CounterMetricFamily(
            "flexcache_engine_submitted", "requests submitted to the engine", value=stats["submitted"]
        )
        yield CounterMetricFamily(
            "flexcache_decode_steps", "batched decode steps the engine ran", value=stats["decode_steps"]
        )


class ServerMetrics:
    """Metrics of one server. `render()` is the `/metrics` body, in Prometheus' text format (`content_type`)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.generated_tokens = Counter(
            "flexcache_generated_tokens",
            "tokens generated for the server's requests (each sequence's own, up to its EOS)",
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "flexcache_prompt_tokens", "prompt tokens of answered requests", registry=self.registry
        )
        self.requests = Counter(
            "flexcache_http_requests", "requests by route and HTTP status", ["route", "status"], registry=self.registry
        )
        self.request_latency = Histogram(
            "flexcache_request_latency_seconds",
            "time from a request's arrival to the end of its answer, answered requests",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "flexcache_time_to_first_token_seconds",
            "time from submitting a request to the engine to its first new token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def answered(self, route: str, *, seconds: float, prompt_tokens: int, generated_tokens: int, handles=()) -> None:
        self.requests.labels(route, "200").inc()
        self.request_latency.labels(route).observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(generated_tokens)
        for handle in handles:
            if handle.first_token_at is not None:
                self.time_to_first_token.observe(handle.first_token_at - handle.submitted_at)

    def refused(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def client_gone(self, route: str, *, generated_tokens: int) -> None:
        """A client that left before its answer ended (status 499, nginx's "client closed request")."""
        self.requests.labels(route, "499").inc()
        self.generated_tokens.inc(generated_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
