"""Prometheus metrics of the server, named `optc:*` (vLLM's names with our prefix).

Histograms and the finished-requests counter are observed by the engine thread as tokens and
finishes happen; gauges and token/prefix-cache counters are read at scrape time from the latest
EngineStats snapshot, so they are never stale by more than one step. The registry belongs to one
server (no global registry), so tests can run several.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from optc.runtime.engine import EngineStats
from optc.runtime.request import Request

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._stats: Callable[[], EngineStats | None] = lambda: None
        labels = ["model_name"]
        self.time_to_first_token = Histogram(
            "optc:time_to_first_token_seconds", "Time from the request's arrival to its first token.",
            labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.inter_token_latency = Histogram(
            "optc:inter_token_latency_seconds", "Time between two tokens of one request.",
            labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e_latency = Histogram(
            "optc:e2e_request_latency_seconds", "Time from the request's arrival to its finish.",
            labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.finished = Counter(
            "optc:request_success", "Finished requests by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"], registry=self.registry)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(model_name, reason)
        self.registry.register(_StatsCollector(self))

    def bind(self, stats: Callable[[], EngineStats | None]) -> None:
        """Where scrapes read the engine's state: a callable giving the latest snapshot."""
        self._stats = stats

    def observe_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def observe_finish(self, request: Request, reason: str, arrival_time: float, now: float) -> None:
        self.finished.labels(self.model_name, reason).inc()
        self.e2e_latency.observe(now - arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StatsCollector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats, name = self.metrics._stats(), self.metrics.model_name
        gauges = {
            "optc:num_requests_running": ("Requests in the running batch.", "num_running"),
            "optc:num_requests_waiting": ("Requests waiting to run.", "num_waiting"),
            "optc:kv_cache_usage_perc": ("Fraction of KV-cache blocks in use (0 to 1).", "kv_usage"),
        }
        counters = {
            "optc:prompt_tokens": ("Prompt tokens of every request added.", "num_prompt_tokens"),
            "optc:generation_tokens": ("Tokens generated.", "num_generated_tokens"),
            "optc:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.",
                                          "num_prefix_cache_query_tokens"),
            "optc:prefix_cache_hits": ("Prompt tokens found in the prefix cache.", "num_prefix_cache_hit_tokens"),
            "optc:num_preemptions": ("Requests preempted (their KV blocks freed, recomputed later).",
                                     "num_preemptions"),
            # speculative decoding, whatever the proposer (vLLM's spec_decode_* counters)
            "optc:spec_decode_num_drafts": ("Verifications of a request with at least one draft token.",
                                            "num_drafts"),
            "optc:spec_decode_num_draft_tokens": ("Draft tokens proposed.", "num_draft_tokens"),
            "optc:spec_decode_num_accepted_tokens": ("Draft tokens accepted.", "num_accepted_tokens"),
        }
        for metric, (doc, attr) in gauges.items():
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], float(getattr(stats, attr)) if stats else 0.0)
            yield family
        for metric, (doc, attr) in counters.items():
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], float(getattr(stats, attr)) if stats else 0.0)
            yield family
        family = CounterMetricFamily("optc:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted at each draft position.", labels=["model_name", "position"])
        for position, count in enumerate(stats.num_accepted_tokens_per_position if stats else ()):
            family.add_metric([name, str(position)], float(count))
        yield family
