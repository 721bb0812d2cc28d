"""Prometheus metrics under vLLM's names, so dashboards, KEDA triggers and the Gateway API
Inference Extension read a kvscale replica like a vLLM one; plus kvscale's own KV block gauges.

Gauges and the engine's cumulative counters come from the latest EngineStats snapshot at scrape
time (a custom collector); per-request counters and histograms are fed as outputs pass through
the event loop. Every app gets its own CollectorRegistry, so several servers (or tests) in one
process never share series. Names, types and help texts come from kvscale/metric_names.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvscale import metric_names as names
from kvscale.metric_registry import register
from kvscale.server.core.kv_tier_policy import RESTORE_BUCKETS
from kvscale.server.engine.engine_front import RequestStream
from kvscale.server.engine.kv_events_vllm import STAT_BATCHES_DROPPED, STAT_EVENTS_DROPPED
from kvscale.server.engine.kv_publisher import STAT_EVENTS_DROPPED as STAT_INDEX_EVENTS_DROPPED
from kvscale.server.outputs import EngineStats, RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Routes counted by name in kvscale:http_requests; anything else is "other" (bounded labels).
COUNTED_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models",
                  "/tokenize", "/detokenize")

# vLLM's buckets, so histogram_quantile over mixed fleets lines up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
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

        def family(metric: names.Metric, value: float) -> Metric:
            cls = CounterMetricFamily if metric.type == names.COUNTER else GaugeMetricFamily
            out = cls(metric.name, metric.help, labels=list(metric.labels))
            out.add_metric(label, value)
            return out

        yield family(names.NUM_REQUESTS_RUNNING, stats.num_running)
        yield family(names.NUM_REQUESTS_WAITING, stats.num_waiting)
        yield family(names.KV_CACHE_USAGE, stats.kv_cache_usage)
        yield family(names.PREFIX_CACHE_QUERIES, stats.prefix_cache_queries)
        yield family(names.PREFIX_CACHE_HITS, stats.prefix_cache_hits)
        yield family(names.NUM_PREEMPTIONS, stats.num_preemptions)
        yield family(names.KV_BLOCKS_TOTAL, stats.kv_blocks_total)
        yield family(names.KV_BLOCKS_ACTIVE, stats.kv_blocks_active)
        yield family(names.KV_BLOCKS_CACHED, stats.kv_blocks_cached)
        yield family(names.KV_BLOCKS_EVICTED, stats.extra.get("kv_blocks_evicted_total", 0.0))
        yield family(names.MAX_NUM_SEQS, stats.extra.get("max_num_seqs", 0.0))
        yield family(names.PREFILL_TOKENS_WAITING, stats.extra.get("prefill_tokens_waiting", 0.0))
        yield family(names.PREFILL_TOKENS_PER_S, stats.extra.get("prefill_tokens_per_s", 0.0))
        yield family(names.STRUCTURED_MASK_SECONDS, stats.extra.get("structured_mask_seconds_total", 0.0))
        yield family(names.STRUCTURED_MASK_STEPS, stats.extra.get("structured_mask_steps_total", 0.0))
        yield family(names.STRUCTURED_FORCED_TOKENS, stats.extra.get("structured_forced_tokens_total", 0.0))
        for metric in (names.SPEC_DECODE_NUM_DRAFTS, names.SPEC_DECODE_NUM_DRAFT_TOKENS,
                       names.SPEC_DECODE_NUM_ACCEPTED_TOKENS):
            yield family(metric, stats.extra.get(f"{metric.name.removeprefix('vllm:')}_total", 0.0))
        yield family(names.KV_EVENTS_BATCHES_DROPPED, stats.extra.get(STAT_BATCHES_DROPPED, 0.0))
        yield family(names.KV_EVENTS_DROPPED, stats.extra.get(STAT_EVENTS_DROPPED, 0.0))
        yield family(names.KV_INDEX_EVENTS_DROPPED, stats.extra.get(STAT_INDEX_EVENTS_DROPPED, 0.0))
        info = names.CACHE_CONFIG_INFO
        config = GaugeMetricFamily(info.name, info.help, labels=list(info.labels))
        prefix_caching = stats.extra.get("enable_prefix_caching", 1.0)
        config.add_metric([self._model_name, str(stats.block_size), str(stats.kv_blocks_total),
                           "True" if prefix_caching else "False", stats.kv_cache_dtype], 1.0)
        yield config
        lora = names.LORA_REQUESTS_INFO
        lora_info = GaugeMetricFamily(lora.name, lora.help, labels=list(lora.labels))
        lora_info.add_metric([",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters),
                              str(int(stats.extra.get("max_loras", 0.0)))], time.time())
        yield lora_info
        yield from self._host_tier(stats, label, family)

    @staticmethod
    def _host_tier(stats: EngineStats, label: list[str], family: Callable[[names.Metric, float], Metric]) -> Iterator[Metric]:
        """The second KV tier (zeros when there is none, so every replica exports the contract)."""
        extra = stats.extra
        for metric, key in ((names.KV_OFFLOAD_BYTES, "kv_offload_bytes"), (names.KV_OFFLOAD_TIME, "kv_offload_seconds")):
            out = CounterMetricFamily(metric.name, metric.help, labels=list(metric.labels))
            out.add_metric(label + ["GPU_to_CPU"], extra.get(f"{key}_gpu_to_cpu", 0.0))
            out.add_metric(label + ["CPU_to_GPU"], extra.get(f"{key}_cpu_to_gpu", 0.0))
            yield out
        yield family(names.EXTERNAL_PREFIX_CACHE_QUERIES, extra.get("external_prefix_cache_queries_total", 0.0))
        yield family(names.EXTERNAL_PREFIX_CACHE_HITS, extra.get("external_prefix_cache_hits_total", 0.0))
        total = extra.get("kv_host_blocks_total", 0.0)
        cached = extra.get("kv_host_blocks_cached", 0.0)
        yield family(names.CPU_CACHE_USAGE, extra.get("kv_host_blocks_used", 0.0) / total if total else 0.0)
        yield family(names.KV_HOST_BLOCKS_TOTAL, total)
        yield family(names.KV_HOST_BLOCKS_CACHED, cached)
        yield family(names.KV_BLOCKS_DEMOTED, extra.get("kv_blocks_demoted_total", 0.0))
        yield family(names.KV_BLOCKS_PROMOTED, extra.get("kv_blocks_promoted_total", 0.0))
        yield family(names.KV_PREEMPTIONS_SWAPPED, extra.get("kv_preemptions_swapped_total", 0.0))
        metric = names.KV_RESTORE_SECONDS
        histogram = HistogramMetricFamily(metric.name, metric.help, labels=list(metric.labels))
        buckets = [(f"{b:g}", extra.get(f"kv_restore_seconds_le_{b:g}", 0.0)) for b in RESTORE_BUCKETS]
        buckets.append(("+Inf", extra.get("kv_restore_seconds_count", 0.0)))
        histogram.add_metric(label, buckets, extra.get("kv_restore_seconds_sum", 0.0))
        yield histogram


class ServerMetrics:
    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats | None]) -> None:
        # vLLM exposes no *_created series; neither do we (process-wide switch, set on purpose).
        disable_created_metrics()
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry

        self.prompt_tokens = register(names.PROMPT_TOKENS, reg).labels(model_name)
        self.generation_tokens = register(names.GENERATION_TOKENS, reg).labels(model_name)
        self.request_success = register(names.REQUEST_SUCCESS, reg)
        self.http_requests = register(names.HTTP_REQUESTS, reg)
        self.ttft = register(names.TTFT, reg, TTFT_BUCKETS).labels(model_name)
        self.itl = register(names.ITL, reg, ITL_BUCKETS).labels(model_name)
        self.e2e = register(names.E2E_LATENCY, reg, REQUEST_BUCKETS).labels(model_name)
        self.queue_time = register(names.QUEUE_TIME, reg, REQUEST_BUCKETS).labels(model_name)
        self.structured_requests = register(names.STRUCTURED_REQUESTS, reg)
        self.compile_seconds = register(names.STRUCTURED_COMPILE_SECONDS, reg, COMPILE_BUCKETS).labels(model_name)
        self.compile_cache_hits = register(names.STRUCTURED_COMPILE_CACHE_HITS, reg).labels(model_name)
        self.structured_refusals = register(names.STRUCTURED_REFUSALS, reg)
        self.tool_parse_failures = register(names.TOOL_CALL_PARSE_FAILURES, reg).labels(model_name)
        self.unknown_fields = register(names.UNKNOWN_REQUEST_FIELDS, reg)
        self.lora_requests = register(names.LORA_REQUESTS, reg)
        self.lora_requests.labels(model_name, "")
        for reason in ("unsupported", "timeout", "invalid"):
            self.structured_refusals.labels(model_name, reason)
        for kind in ("json", "json_object", "regex", "choice", "grammar", "tool"):
            self.structured_requests.labels(model_name, kind)
        for endpoint in ("/v1/completions", "/v1/chat/completions"):
            self.unknown_fields.labels(model_name, endpoint)
        # Pre-create the usual reasons so rate() works before the first request of each kind.
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        for route in COUNTED_ROUTES:
            self.http_requests.labels(model_name, route, "200")
        reg.register(_EngineStatsCollector(model_name, get_stats))

    def count_unknown_field(self, endpoint: str) -> None:
        self.unknown_fields.labels(self.model_name, endpoint).inc()

    def count_lora_request(self, lora_name: str) -> None:
        self.lora_requests.labels(self.model_name, lora_name).inc()

    def forget_lora(self, lora_name: str) -> None:
        """An unloaded adapter's series goes (the registry of names is bounded; its history is not)."""
        with contextlib.suppress(KeyError):
            self.lora_requests.remove(self.model_name, lora_name)

    def count_structured(self, kind: str) -> None:
        self.structured_requests.labels(self.model_name, kind).inc()

    def count_refusal(self, reason: str) -> None:
        self.structured_refusals.labels(self.model_name, reason).inc()

    def count_http(self, path: str, status: int) -> None:
        route = path if path in COUNTED_ROUTES else "other"
        self.http_requests.labels(self.model_name, route, str(status)).inc()

    def on_step(self, outputs: list[RequestOutput], streams: dict[str, RequestStream], stats: EngineStats) -> None:
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is None:
                continue
            metrics = output.metrics
            if not stream.first_output_seen:
                stream.first_output_seen = True
                self.prompt_tokens.inc(len(output.prompt_token_ids))
                if metrics is not None and metrics.grammar_cache_hit is not None:
                    if metrics.grammar_cache_hit:
                        self.compile_cache_hits.inc()
                    elif metrics.grammar_compile_s is not None:
                        self.compile_seconds.observe(metrics.grammar_compile_s)
                if metrics is not None:
                    if metrics.first_scheduled_time is not None:
                        self.queue_time.observe(max(0.0, metrics.first_scheduled_time - metrics.arrival_time))
                    if metrics.first_token_time is not None:
                        self.ttft.observe(max(0.0, metrics.first_token_time - metrics.arrival_time))
            # Outputs are deltas: their token ids are the step's new tokens.
            new_tokens = sum(len(completion.token_ids) for completion in output.outputs)
            if new_tokens > 0:
                self.generation_tokens.inc(new_tokens)
                token_time = metrics.last_token_time if metrics is not None else None
                if token_time is not None:
                    if stream.last_token_time is not None:
                        self.itl.observe(max(0.0, token_time - stream.last_token_time))
                    stream.last_token_time = token_time
                stream.tokens_seen += new_tokens
            if output.finished and metrics is not None:
                end = metrics.finished_time or metrics.last_token_time
                if end is not None:
                    self.e2e.observe(max(0.0, end - metrics.arrival_time))

    def on_request_end(self, stream: RequestStream, finish_reason: str) -> None:
        self.request_success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class HTTPStatusMiddleware:
    """Pure ASGI middleware counting every answered request by route and status code."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception before the response started

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.count_http(scope.get("path", ""), status)
