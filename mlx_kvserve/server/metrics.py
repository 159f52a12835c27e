"""Prometheus metrics for one app: per-request counters and histograms fed from RequestRecords, and
the engine's queue and cache statistics read at scrape time.

Each app owns its CollectorRegistry (never the process-global one), so several apps can live in one
process (tests) without clashing names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.front import EngineFront

PREFIX = "mlx_kvserve_"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TIMEOUT_KINDS = {"first_token_timeout": "first_token", "request_timeout": "total", "body_timeout": "body"}
_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class RequestRecord:
    """What one HTTP request did. The gate fills in the id, endpoint, status and duration; the
    completion handler the token counts, the first token and an error that ended a stream."""

    request_id: str
    method: str
    path: str
    started: float  # time.monotonic() at arrival
    endpoint: str = "other"  # the matched route's path; "other" for unknown paths
    status: int = 0
    stream: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    first_token_s: float | None = None  # arrival to the first generated token
    duration_s: float = 0.0
    error: str = ""  # code or type of the error that ended the request ("" = none)
    key_name: str = ""  # the principal whose key opened it (api_keys.Principal.name; never the key)

    def mark_first_token(self) -> None:
        if self.first_token_s is None:
            self.first_token_s = time.monotonic() - self.started


class EngineCollector(Collector):
    """Reads the engine's queue and cache counters when scraped; it keeps no state of its own."""

    def __init__(self, engine: EngineFront):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        yield GaugeMetricFamily(PREFIX + "queue_depth", "Requests waiting for the worker", value=engine.queue_depth)
        yield GaugeMetricFamily(PREFIX + "worker_busy", "1 while the worker generates", value=int(engine.is_busy))
        yield from _batch_metrics(self.engine.batch_stats())
        stats = self.engine.cache_stats()
        enabled = bool(stats.get("enabled"))
        yield GaugeMetricFamily(PREFIX + "cache_enabled", "1 when block caching is on", value=int(enabled))
        if enabled:
            yield from _cache_metrics(stats, ssd="ssd_bytes" in stats)


def _batch_metrics(b: dict[str, Any]) -> Iterator[Metric]:
    """The batch's gauges, and its work as counters (rate(tokens) / rate(seconds) = tokens/s)."""
    yield GaugeMetricFamily(PREFIX + "requests_running", "Requests in the batch", value=b["running"])
    yield GaugeMetricFamily(PREFIX + "batch_size", "Requests in mlx-lm's batch now", value=b["batch_size"])
    for phase in ("prefill", "decode"):
        yield CounterMetricFamily(
            PREFIX + f"{phase}_tokens", f"Tokens run through the model by {phase}", b[f"{phase}_tokens"]
        )
        yield CounterMetricFamily(PREFIX + f"{phase}_seconds", f"Seconds the batch spent in {phase}", b[f"{phase}_s"])
    yield CounterMetricFamily(
        PREFIX + "shared_prefix_waits", "Requests that waited for another's prompt blocks", b["shared_prefix_waits"]
    )
    spec = b.get("speculative", {})
    for key, what in (("drafted_tokens", "Draft tokens verified"), ("accepted_tokens", "Draft tokens accepted")):
        yield CounterMetricFamily(PREFIX + f"speculative_{key}", f"{what} (speculative decoding)", spec.get(key, 0))


def _by_tier(family: CounterMetricFamily | GaugeMetricFamily, values: dict[str, float]) -> Metric:
    for tier, value in values.items():
        family.add_metric([tier], value)
    return family


def _cache_metrics(s: dict[str, Any], ssd: bool) -> Iterator[Metric]:
    """Cache families from the engine's stats: blocks reused from RAM are the hits that were not
    promoted from the SSD; a RAM miss is a lookup whose chain left RAM, an SSD miss one that left both."""
    get = s.get
    promotions = get("kv_promotions", 0)
    hits = {"ram": get("kv_hits", 0) - promotions} | ({"ssd": promotions} if ssd else {})
    misses = {"ram": get("kv_misses", 0)} | ({"ssd": get("ssd_misses", 0)} if ssd else {})
    stored = {"ram": get("kv_ram_bytes", 0) + get("kv_tail_bytes", 0)} | ({"ssd": get("ssd_bytes", 0)} if ssd else {})
    blocks = {"ram": get("kv_ram_blocks", 0)} | ({"ssd": get("ssd_blocks", 0)} if ssd else {})
    evictions = {"ram": get("kv_evictions", 0)} | ({"ssd": get("ssd_evictions", 0)} if ssd else {})
    yield _by_tier(CounterMetricFamily(PREFIX + "cache_hits", "Full KV blocks reused, by tier", labels=["tier"]), hits)
    yield _by_tier(CounterMetricFamily(PREFIX + "cache_misses", "Block lookups that missed", labels=["tier"]), misses)
    yield _by_tier(GaugeMetricFamily(PREFIX + "cache_bytes", "Bytes of KV held, by tier", labels=["tier"]), stored)
    yield _by_tier(GaugeMetricFamily(PREFIX + "cache_blocks", "Full blocks held, by tier", labels=["tier"]), blocks)
    yield _by_tier(
        CounterMetricFamily(PREFIX + "cache_evictions", "Blocks evicted, by tier", labels=["tier"]), evictions
    )
    yield CounterMetricFamily(PREFIX + "cache_tail_hits", "Lookups extended by a partial block", get("kv_tail_hits", 0))
    hit_tokens = get("kv_hit_tokens", 0) + get("kv_tail_hit_tokens", 0)
    yield CounterMetricFamily(
        PREFIX + "cache_hit_tokens", "Prompt tokens not prefilled thanks to the cache", hit_tokens
    )
    if ssd:
        yield GaugeMetricFamily(
            PREFIX + "ssd_writer_queue_depth", "Blocks waiting for the SSD writer", value=get("writer_queue_depth", 0)
        )
        yield GaugeMetricFamily(
            PREFIX + "ssd_writer_queued_bytes",
            "Bytes waiting in the SSD writer's queue",
            value=get("writer_queued_bytes", 0),
        )
        yield GaugeMetricFamily(
            PREFIX + "ssd_writer_owed_bytes",
            "Bytes shed from the writer's queue still owed to the SSD (written when it runs empty)",
            value=get("writer_owed_bytes", 0),
        )
        yield CounterMetricFamily(
            PREFIX + "ssd_blocks_written", "Blocks the SSD writer saved", get("writer_written", 0)
        )
        yield CounterMetricFamily(
            PREFIX + "ssd_writer_shed", "Blocks and tails shed from the writer's full queue", get("writer_shed", 0)
        )
        yield CounterMetricFamily(
            PREFIX + "ssd_writer_refilled", "Shed blocks and tails taken back by the writer", get("writer_refilled", 0)
        )
        yield CounterMetricFamily(PREFIX + "ssd_write_errors", "Failed SSD write attempts", get("ssd_errors", 0))
        yield CounterMetricFamily(
            PREFIX + "ssd_writer_failures", "Blocks the writer gave up on after its retries", get("writer_failures", 0)
        )


class ServerMetrics:
    """The app's metrics. `observe` is called once per finished HTTP request (on the event loop)."""

    def __init__(self, engine: EngineFront):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.duration = Histogram(
            PREFIX + "request_duration_seconds",
            "Arrival to last byte",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival to first token",
            ["endpoint"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.cached_tokens = Counter(PREFIX + "cached_prompt_tokens", "Prompt tokens served from the cache", registry=r)
        self.completion_tokens = Counter(PREFIX + "completion_tokens", "Tokens generated", registry=r)
        self.timeouts = Counter(PREFIX + "request_timeouts", "Requests cut short by a timeout", ["kind"], registry=r)
        self.in_flight = Gauge(PREFIX + "requests_in_flight", "Completion requests admitted, not finished", registry=r)
        r.register(EngineCollector(engine))

    def track_in_flight(self, read: Callable[[], int]) -> None:
        self.in_flight.set_function(read)

    def observe(self, record: RequestRecord) -> None:
        self.requests.labels(record.endpoint, str(record.status)).inc()
        self.duration.labels(record.endpoint).observe(record.duration_s)
        if record.first_token_s is not None:
            self.ttft.labels(record.endpoint).observe(record.first_token_s)
        self.prompt_tokens.inc(record.prompt_tokens)
        self.cached_tokens.inc(record.cached_tokens)
        self.completion_tokens.inc(record.completion_tokens)
        if kind := _TIMEOUT_KINDS.get(record.error):
            self.timeouts.labels(kind).inc()

    content_type = CONTENT_TYPE_LATEST

    def render(self) -> bytes:
        """The text exposition format; reads the engine's stats (takes their locks briefly)."""
        return generate_latest(self.registry)
