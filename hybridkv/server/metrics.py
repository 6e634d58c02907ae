"""Prometheus metrics of one server: engine gauges read at scrape time, plus TTFT.

Each app gets its own ``CollectorRegistry`` (two apps in one process, as tests make, do not
collide). Engine state (running / waiting requests, pages per group, prefix-cache tokens,
preemptions, tokens) is not mirrored into prometheus objects as it changes: a collector
turns the ``engine.stats()`` snapshot taken for the scrape into metric families, so the
numbers a scrape shows are those of one moment between two steps. Totals the engine keeps
(hit tokens, preemptions) are exported as counters with their absolute values.

Time to first token is measured by the engine (arrival to first sampled token) and
observed here once per request, when the server first sees a token of it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "hybridkv"
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# stats() key -> (metric name, help) for the engine-wide gauges and counters.
_GAUGES = {
    "num_running": ("num_requests_running", "Sequences scheduled in the running batch"),
    "num_waiting": ("num_requests_waiting", "Sequences waiting to be scheduled"),
    "state_pages_used": ("state_pages_used", "Recurrent-state pages held by sequences"),
    "free_chunks": ("arena_free_chunks", "Arena chunks not owned by any group"),
}
_COUNTERS = {
    "prefix_cache_hits": ("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"),
    "prefix_cache_queries": ("prefix_cache_query_tokens", "Prompt tokens looked up in the cache"),
    "num_preemptions": ("preemptions", "Sequences preempted to free pages"),
    "generation_tokens": ("generation_tokens", "Tokens generated"),
    "prompt_tokens": ("prompt_tokens", "Prompt tokens of admitted requests"),
    "num_requests_finished": ("requests_finished", "Requests finished (any reason)"),
}
_GROUP_GAUGES = {
    "pages_used": ("pages_used", "Pages held by running sequences, per layer group"),
    "pages_free": ("pages_free", "Pages free in the group's chunks, per layer group"),
    "pages_cached": ("pages_cached", "Pages kept only by the prefix cache, per layer group"),
}


class _EngineCollector(Collector):
    """Yields metric families from the last stats snapshot given to :meth:`update`."""

    def __init__(self) -> None:
        self.stats: Mapping[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if not stats:
            return
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=stats[key])
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=stats[key])
        for key, (name, doc) in _GROUP_GAUGES.items():
            family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["group", "kind"])
            for group in stats["groups"]:
                family.add_metric([str(group["group_id"]), group["kind"]], group[key])
            yield family


class ServerMetrics:
    """The registry of one app and the metrics the server records itself."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(max(0.0, seconds))

    def render(self, stats: Mapping[str, Any]) -> bytes:
        """The exposition text for a scrape, engine gauges taken from ``stats``."""
        self._engine.stats = stats
        return generate_latest(self.registry)
