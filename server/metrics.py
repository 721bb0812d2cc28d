"""Prometheus metrics under vLLM's names, so dashboards, KEDA triggers and the Gateway API
Inference Extension read a kvscale replica like a vLLM one; plus kvscale's own KV block gauges.

Gauges and the engine's cumulative counters come from the latest EngineStats snapshot at scrape
time (a custom collector); per-request counters and histograms are fed as outputs pass through
the event loop. Every app gets its own CollectorRegistry, so several servers (or tests) in one
process never share series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvscale.server.async_engine import RequestStream
from kvscale.server.outputs import EngineStats, RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, so histogram_quantile over mixed fleets lines up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineStatsCollector(Collector):
    """Reads the newest EngineStats at scrape time."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats | None]) -> None:
        self._model_name = model_name
        self._get_stats = get_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._get_stats()
        if stats is None:
            return
        label = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV cache usage as a fraction in [0, 1]: blocks held by live requests / all blocks.",
            stats.kv_cache_usage,
        )
        yield counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits
        )
        yield counter("vllm:num_preemptions", "Preemptions of running requests.", stats.num_preemptions)
        yield gauge("kvscale:kv_blocks_total", "KV cache blocks in the pool.", stats.kv_blocks_total)
        yield gauge(
            "kvscale:kv_blocks_active",
            "KV blocks held by live (running or preempted-and-holding) requests; not reclaimable.",
            stats.kv_blocks_active,
        )
        yield gauge(
            "kvscale:kv_blocks_cached",
            "Free KV blocks still holding a reusable prefix; evicted on demand, so free capacity.",
            stats.kv_blocks_cached,
        )


class ServerMetrics:
    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats | None]) -> None:
        # vLLM exposes no *_created series; neither do we (process-wide switch, set on purpose).
        disable_created_metrics()
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated.", labels, registry=reg
        ).labels(model_name)
        self.request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason.",
            ["model_name", "finished_reason"], registry=reg,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels,
            buckets=TTFT_BUCKETS, registry=reg,
        ).labels(model_name)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between successive output tokens.", labels,
            buckets=ITL_BUCKETS, registry=reg,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish.", labels,
            buckets=REQUEST_BUCKETS, registry=reg,
        ).labels(model_name)
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds", "Arrival to first scheduled.", labels,
            buckets=REQUEST_BUCKETS, registry=reg,
        ).labels(model_name)
        # Pre-create the usual reasons so rate() works before the first request of each kind.
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        reg.register(_EngineStatsCollector(model_name, get_stats))

    def on_step(self, outputs: list[RequestOutput], streams: dict[str, RequestStream], stats: EngineStats) -> None:
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is None:
                continue
            metrics = output.metrics
            if not stream.first_output_seen:
                stream.first_output_seen = True
                self.prompt_tokens.inc(len(output.prompt_token_ids))
                if metrics is not None:
                    if metrics.first_scheduled_time is not None:
                        self.queue_time.observe(max(0.0, metrics.first_scheduled_time - metrics.arrival_time))
                    if metrics.first_token_time is not None:
                        self.ttft.observe(max(0.0, metrics.first_token_time - metrics.arrival_time))
            num_tokens = sum(len(completion.token_ids) for completion in output.outputs)
            new_tokens = num_tokens - stream.tokens_seen
            if new_tokens > 0:
                self.generation_tokens.inc(new_tokens)
                token_time = metrics.last_token_time if metrics is not None else None
                if token_time is not None:
                    if stream.last_token_time is not None:
                        self.itl.observe(max(0.0, token_time - stream.last_token_time))
                    stream.last_token_time = token_time
                stream.tokens_seen = num_tokens
            if output.finished and metrics is not None:
                end = metrics.finished_time or metrics.last_token_time
                if end is not None:
                    self.e2e.observe(max(0.0, end - metrics.arrival_time))

    def on_request_end(self, stream: RequestStream, finish_reason: str) -> None:
        self.request_success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
