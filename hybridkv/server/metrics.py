"""Prometheus metrics of one server, under vLLM's names so its Grafana dashboards work.

Every series carries ``model_name`` (the served name) and ``engine="0"``, as vLLM's do.
vLLM's names (``vllm:``): running / waiting requests, KV-cache usage, prefix-cache queries
and hits (tokens), prompt and generation tokens, preemptions, finished requests by reason,
and the time-to-first-token, inter-token and end-to-end latency histograms (vLLM's
buckets). hybridkv's own (``hybridkv:``): pages per layer group, state pages and
snapshots (taken, kept, dropped by retention, evicted), hybrid misses (prompt tokens whose
KV was cached but had no state snapshot to resume from), and the capacity plan (KV
token capacity, state slots, the concurrency cap and the resource that binds it, the
padding waste, the unified-page comparison). docs/grafana-hybridkv.json charts them.

Engine state is not mirrored into prometheus objects as it changes: a collector turns the
``engine.stats()`` snapshot taken for the scrape into metric families, so a scrape shows
one moment between two steps; totals the engine keeps are exported as counters with their
absolute values. The latency histograms are observed here, from each request's
:class:`~hybridkv.engine.outputs.RequestMetrics` (TTFT at its first token, the rest when
it finishes).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridkv.engine.outputs import RequestOutput

LABELS = ("model_name", "engine")
# vLLM's buckets (vllm/v1/metrics/buckets.py)
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error")

# stats() key -> (metric name, help)
_GAUGES = {
    "num_running": ("vllm:num_requests_running", "Number of requests in model execution batches."),
    "num_waiting": ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    "kv_cache_usage": (
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage (arena bytes held by running requests).",
    ),
    "state_pages_used": ("hybridkv:state_pages_used", "State pages held: live states, snapshots"),
    "state_snapshots_kept": (
        "hybridkv:state_snapshots_kept",
        "State snapshots in the prefix cache, per recurrent group",
    ),
    "free_chunks": ("hybridkv:arena_free_chunks", "Arena chunks not owned by any layer group"),
}
_COUNTERS = {
    "prefix_cache_queries": (
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    "prefix_cache_hits": (
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    "prompt_tokens": ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    "generation_tokens": ("vllm:generation_tokens", "Number of generation tokens processed."),
    "num_preemptions": ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    "prefix_cache_hybrid_misses": (
        "hybridkv:prefix_cache_hybrid_misses",
        "Prompt tokens whose KV was cached but had no state snapshot to resume from",
    ),
    "state_snapshots_taken": (
        "hybridkv:state_snapshots_taken",
        "State snapshots taken, per recurrent group",
    ),
    "state_snapshots_dropped": (
        "hybridkv:state_snapshots_dropped",
        "Superseded state snapshots let go by the retention rule",
    ),
    "state_snapshots_evicted": (
        "hybridkv:state_snapshots_evicted",
        "State snapshots evicted from the prefix cache for room",
    ),
    # speculative decoding (zero without speculation)
    "spec_decode_num_drafts": ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    "spec_decode_num_draft_tokens": (
        "vllm:spec_decode_num_draft_tokens",
        "Number of draft tokens.",
    ),
    "spec_decode_num_accepted_tokens": (
        "vllm:spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
    ),
}
_GROUP_GAUGES = {
    "pages_used": ("hybridkv:pages_used", "Pages held by running requests, per layer group"),
    "pages_free": ("hybridkv:pages_free", "Pages free in the group's chunks, per layer group"),
    "pages_cached": ("hybridkv:pages_cached", "Pages kept only by the prefix cache, per group"),
}
# capacity plan key -> (metric name, help); constant for the server's life
_CAPACITY = {
    "kv_capacity_tokens": (
        "hybridkv:kv_capacity_tokens",
        "KV token capacity of the attention groups with max_num_seqs live states",
    ),
    "physical_limit_tokens": (
        "hybridkv:kv_physical_limit_tokens",
        "floor((memory - max_num_seqs * state bytes) / KV bytes per token)",
    ),
    "padding_waste_bytes": ("hybridkv:padding_waste_bytes", "Arena bytes lost to page padding"),
    "memory_bytes": ("hybridkv:cache_memory_bytes", "Bytes given to the cache"),
}


class _EngineCollector(Collector):
    """Yields metric families from the last stats snapshot given to :meth:`update`."""

    def __init__(self, labels: tuple[str, str]) -> None:
        self.labels = list(labels)
        self.stats: Mapping[str, Any] = {}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self.labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self.labels, value)
        return family

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if not stats:
            return
        for key, (name, doc) in _GAUGES.items():
            yield self._gauge(name, doc, stats[key])
        for key, (name, doc) in _COUNTERS.items():
            yield self._counter(name, doc, stats[key])
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*LABELS, "finished_reason"],
        )
        by_reason = stats["requests_finished_by_reason"]
        for reason in sorted(set(FINISH_REASONS) | by_reason.keys()):
            success.add_metric([*self.labels, reason], by_reason.get(reason, 0))
        yield success
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*LABELS, "position"],
        )
        for position, kept in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
            per_position.add_metric([*self.labels, str(position)], kept)
        yield per_position
        for key, (name, doc) in _GROUP_GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=[*LABELS, "group", "kind"])
            for group in stats["groups"]:
                family.add_metric([*self.labels, str(group["group_id"]), group["kind"]], group[key])
            yield family
        yield from self._capacity(stats["capacity"])

    def _capacity(self, plan: Mapping[str, Any]) -> Iterator[Metric]:
        for key, (name, doc) in _CAPACITY.items():
            if plan.get(key) is not None:
                yield self._gauge(name, doc, plan[key])
        c = plan["concurrency"]
        if c["state_bound"] is not None:
            yield self._gauge(
                "hybridkv:state_slots", "Live states the arena holds", c["state_bound"]
            )
        cap = GaugeMetricFamily(
            "hybridkv:max_concurrency",
            "Sequences of max_model_len that run at once; 'binding' names the resource that "
            "sets it (max_num_seqs, kv_cache or state)",
            labels=[*LABELS, "binding"],
        )
        cap.add_metric([*self.labels, c["binding"]], c["effective"])
        yield cap
        bound = GaugeMetricFamily(
            "hybridkv:max_concurrency_bound",
            "Each bound on sequences of max_model_len at once",
            labels=[*LABELS, "resource"],
        )
        for resource, key in (("kv_cache", "kv_bound"), ("state", "state_bound")):
            if c[key] is not None:
                bound.add_metric([*self.labels, resource], c[key])
        bound.add_metric([*self.labels, "max_num_seqs"], c["max_num_seqs"])
        bound.add_metric([*self.labels, "kv_and_state"], c["joint"])
        yield bound
        unified = plan["unified_page_baseline"]
        if unified["kv_capacity_tokens"] is not None:
            yield self._gauge(
                "hybridkv:unified_page_kv_capacity_tokens",
                "KV tokens one unified page size (vLLM's sizing) would give in the same memory",
                unified["kv_capacity_tokens"],
            )
        yield self._gauge(
            "hybridkv:unified_page_max_concurrency",
            "Sequences of max_model_len at once under one unified page size",
            unified["max_concurrency"],
        )


class ServerMetrics:
    """The registry of one app and the metrics the server records itself.

    Args:
        model_name: the served model name, the ``model_name`` label of every series.
    """

    def __init__(self, model_name: str = "") -> None:
        self.labels = (model_name, "0")
        self.registry = CollectorRegistry()
        self._engine = _EngineCollector(self.labels)
        self.registry.register(self._engine)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS_S,
        ).labels(*self.labels)
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS_S,
        ).labels(*self.labels)
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            E2E_BUCKETS_S,
        ).labels(*self.labels)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(max(0.0, seconds))

    def observe_finished(self, out: RequestOutput) -> None:
        """A finished request's inter-token gaps and end-to-end latency."""
        if out.metrics is None:
            return
        for gap in out.metrics.inter_token_latencies:
            self.itl.observe(gap)
        if out.metrics.e2e_latency is not None:
            self.e2e.observe(max(0.0, out.metrics.e2e_latency))

    def render(self, stats: Mapping[str, Any]) -> bytes:
        """The exposition text for a scrape, engine gauges taken from ``stats``."""
        self._engine.stats = stats
        return generate_latest(self.registry)
