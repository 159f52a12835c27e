"""The router's Prometheus metrics: decisions by policy and reason, estimated vs reported cached tokens,
per-backend latency and failures, and each backend's state read at scrape time. One registry per app."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .backends import BackendState

PREFIX = "mlx_kvserve_router_"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class BackendCollector(Collector):
    """Each backend's up flag, load and block count, read when scraped."""

    def __init__(self, backends: Callable[[], Sequence[BackendState]]):
        self.backends = backends

    def collect(self) -> Iterator[Metric]:
        families = {
            "backend_up": ("1 while the backend is in rotation", lambda b: int(b.is_up)),
            "backend_requests": ("Requests in flight through the router", lambda b: b.num_requests),
            "backend_pending_prefill_tokens": ("Prefill tokens not yet done", lambda b: b.pending_prefill_tokens),
            "backend_decode_tokens": ("Tokens decoded by requests in flight", lambda b: b.decode_tokens),
            "backend_cached_blocks": ("Blocks the backend reported in RAM", lambda b: b.num_blocks),
            "backend_claim_contradictions": (
                "Routed replies whose cached tokens contradicted the blocks the backend claimed",
                lambda b: b.num_contradictions,
            ),
        }
        backends = list(self.backends())
        for name, (doc, read) in families.items():
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["backend"])
            for b in backends:
                family.add_metric([b.url], read(b))
            yield family


class RouterMetrics:
    def __init__(self, backends: Callable[[], Sequence[BackendState]]):
        self.registry = r = CollectorRegistry()
        self.decisions = Counter(
            PREFIX + "decisions",
            "Routing decisions by policy, reason and backend",
            ["policy", "reason", "backend"],
            registry=r,
        )
        self.requests = Counter(
            PREFIX + "requests", "Proxied requests by backend and status", ["backend", "status"], registry=r
        )
        self.failures = Counter(
            PREFIX + "backend_failures", "Backends taken out of rotation, by kind", ["backend", "kind"], registry=r
        )
        self.retries = Counter(PREFIX + "retries", "Requests sent on to another backend", registry=r)
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens the backends reported", ["backend"], registry=r
        )
        self.estimated_cached = Counter(
            PREFIX + "estimated_cached_tokens", "Cached prompt tokens the router estimated", ["backend"], registry=r
        )
        self.reported_cached = Counter(
            PREFIX + "reported_cached_tokens", "Cached prompt tokens the backends reported", ["backend"], registry=r
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival to first token",
            ["backend"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            PREFIX + "request_duration_seconds",
            "Arrival to last byte",
            ["backend"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.resyncs = Counter(
            PREFIX + "block_resyncs", "Block snapshots taken from a backend", ["backend"], registry=r
        )
        r.register(BackendCollector(backends))

    content_type = CONTENT_TYPE_LATEST

    def render(self) -> bytes:
        return generate_latest(self.registry)
