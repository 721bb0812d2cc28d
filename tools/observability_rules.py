"""kvscale's Prometheus rules as data: the recording rules the alerts and dashboards read, and the
alerts, each with the signal, comparison and threshold the rule-file tests evaluate."""

from __future__ import annotations

from dataclasses import dataclass

from kvscale import metric_names as m

BY_SERVICE = "namespace, inferenceservice, model_name"
RECORDING = (
    ("kvscale:kv_cache_usage:max", f"max by ({BY_SERVICE}) ({m.KV_CACHE_USAGE.series})"),
    ("kvscale:num_requests_waiting:sum",
     f"sum by ({BY_SERVICE}) ({m.NUM_REQUESTS_WAITING.series})"),
    ("kvscale:prefix_cache_hit_rate:rate5m",
     f"sum by ({BY_SERVICE}) (rate({m.PREFIX_CACHE_HITS.series}[5m])) / "
     f"sum by ({BY_SERVICE}) (rate({m.PREFIX_CACHE_QUERIES.series}[5m]))"),
    ("kvscale:time_to_first_token_seconds:p90_rate5m",
     f"histogram_quantile(0.9, sum by ({BY_SERVICE}, le) (rate({m.TTFT.bucket}[5m])))"),
    ("kvscale:generation_tokens:rate5m",
     f"sum by ({BY_SERVICE}) (rate({m.GENERATION_TOKENS.series}[5m]))"),
    ("kvscale_router:predicted_prefix_hit_rate:rate5m",
     f"sum by (namespace, inferenceservice) (rate({m.ROUTER_PREDICTED_HIT_TOKENS.series}[5m])) / "
     f"sum by (namespace, inferenceservice) (rate({m.ROUTER_PROMPT_TOKENS.series}[5m]))"),
)


@dataclass(frozen=True)
class Alert:
    name: str
    signal: str  # what is compared; tests evaluate `signal <op> bool threshold`
    op: str
    threshold: str
    duration: str
    severity: str
    summary: str

    @property
    def expr(self) -> str:
        return f"{self.signal} {self.op} {self.threshold}"


ALERTS = (
    Alert("KVScaleKVCacheSaturated", "kvscale:kv_cache_usage:max", ">", "0.95", "5m", "warning",
          "KV cache of {{ $labels.inferenceservice }} ({{ $labels.namespace }}) is over 95% "
          "held by live requests: new requests queue or preempt."),
    Alert("KVScaleQueueGrowing", "deriv(kvscale:num_requests_waiting:sum[5m])", ">", "0.05",
          "10m", "warning",
          "Waiting requests of {{ $labels.inferenceservice }} ({{ $labels.namespace }}) keep "
          "growing: the autoscaler is not keeping up, or maxReplicas is too low."),
    Alert("KVScaleRouterInFallback",
          f"sum by (namespace, pod) (rate({m.ROUTER_FALLBACKS.series}[5m]))", ">", "0", "10m",
          "warning",
          "Router {{ $labels.pod }} ({{ $labels.namespace }}) routes without its full prefix "
          "index (Redis down or prompts it cannot tokenize)."),
    Alert("KVScaleAutoscalerAtMaxReplicas", m.OPERATOR_DESIRED.series, ">=",
          m.OPERATOR_MAX.series, "15m", "info",
          "{{ $labels.inferenceservice }} ({{ $labels.namespace }}) wants its maxReplicas: "
          "more load will queue."),
    # Scale from zero: a held request answered 503 (held past activationTimeoutSeconds, or the
    # hold queue full) is a failed request; a disconnected one is the client's choice.
    Alert("KVScaleActivationRefusing",
          f'sum by (namespace, inferenceservice) (increase({m.ROUTER_HOLDS.series}'
          f'{{outcome=~"timeout|full"}}[10m]))', ">", "0", "0m", "warning",
          "Routers of {{ $labels.inferenceservice }} ({{ $labels.namespace }}) answered held "
          "requests 503: no replica came up within activationTimeoutSeconds, or the hold queue "
          "was full."),
    # Down now, though scraped within the hour: a pod still loading its model for the first time
    # (minutes, up to its 30-minute startup probe) was never up, and is not a scrape failure.
    Alert("KVScaleReplicaNotScraped",
          'up{inferenceservice!=""} - max_over_time(up{inferenceservice!=""}[1h])', "<", "0", "5m",
          "warning",
          "Prometheus scraped {{ $labels.pod }} of {{ $labels.inferenceservice }} "
          "({{ $labels.namespace }}) before, and cannot now."),
)


def rules() -> dict:
    return {"groups": [
        {"name": "kvscale.recording", "rules": [
            {"record": name, "expr": expr} for name, expr in RECORDING]},
        {"name": "kvscale.alerts", "rules": [
            {"alert": a.name, "expr": a.expr, "for": a.duration,
             "labels": {"severity": a.severity}, "annotations": {"summary": a.summary}}
            for a in ALERTS]},
    ]}
