"""Generate kvscale's Grafana dashboards (grafanalib) and Prometheus rules from the metric-names
contract, into charts/kvscale/dashboards/*.json and charts/kvscale/rules/kvscale.rules.yaml.

    python tools/gen_observability.py          # write them
    python tools/gen_observability.py --check  # exit 1 when the committed files differ

Every query names its metrics through kvscale/metric_names.py, filters on the dashboard variables
(datasource, namespace, inferenceservice, model_name, pod) and takes rates over
`$__rate_interval`; tests/observability/ evaluates each one against a real Prometheus.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from grafanalib import core as g
from grafanalib._gen import DashboardEncoder

from kvscale import metric_names as m

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD_DIR = ROOT / "charts" / "kvscale" / "dashboards"
RULES_FILE = ROOT / "charts" / "kvscale" / "rules" / "kvscale.rules.yaml"

# A reference to the data source variable, never a UID of someone's Prometheus.
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
# Selectors: server series carry all four labels; the operator's carry namespace and
# inferenceservice; the router's also carry its own pod.
SEL_SERVER = ('namespace=~"$namespace", inferenceservice=~"$inferenceservice", '
              'model_name=~"$model_name", pod=~"$pod"')
SEL_SERVICE = 'namespace=~"$namespace", inferenceservice=~"$inferenceservice"'
NOT_2XX = 'status!~"2.."'
SEL_ROUTER = 'namespace=~"$namespace", inferenceservice=~"$inferenceservice", pod=~"$pod"'


def sel(series: str, selector: str, extra: str = "") -> str:
    inner = f"{selector}, {extra}" if extra else selector
    return f"{series}{{{inner}}}"


def rate(series: str, selector: str, extra: str = "") -> str:
    return f"rate({sel(series, selector, extra)}[{RATE}])"


def quantile(q: float, metric: m.Metric, selector: str) -> str:
    return f"histogram_quantile({q}, sum by (le) ({rate(metric.bucket, selector)}))"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    description: str = ""
    width: int = 12
    bars: bool = False


@dataclass(frozen=True)
class Board:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    pod_source: str  # the series whose `pod` label the pod variable lists
    annotations: tuple[tuple[str, str], ...] = field(default=())  # (name, expr)
    # The series whose namespace / inferenceservice / model_name the variables list: the
    # servers' by default; the router board lists routers, whether or not their servers run.
    service_source: str = m.NUM_REQUESTS_RUNNING.series


def q(expr: str, legend: str) -> Query:
    return Query(expr, legend)


# --------------------------------------------------------------------------------- Autoscaling
SCALE_EVENTS = (f"sum by (namespace, inferenceservice, direction, reason) "
                f"(increase({sel(m.OPERATOR_SCALE_DECISIONS.series, SEL_SERVICE)}[{RATE}])) > 0")

# The rule of operator/scaling.py, as its docstring and docs/operator.md write it.
LOAD_RULE = ("load = max(Σ occupancy / targetKVUsage + Σ waiting / targetQueueLength, "
             "Σ prefill seconds / targetPrefillSeconds), Σ over pods: per pod, occupancy is the "
             "fuller of KV blocks held by live requests and batch slots in use, prefill seconds "
             "its kvscale:prefill_tokens_waiting / kvscale:prefill_tokens_per_s. The two "
             "measures are not added: either alone needs that many replicas. Desired replicas "
             "follow ceil(load) through the stabilization windows, panic mode and the step "
             "limit, within min/max.")

AUTOSCALING = Board(
    uid="kvscale-autoscaling",
    title="kvscale / Autoscaling",
    description="Why the operator added or removed replicas: its signal, target and decisions.",
    pod_source=m.NUM_REQUESTS_RUNNING.series,
    annotations=(("Scale decisions", SCALE_EVENTS),),
    panels=(
        Panel("Occupancy signal vs target", (
            q(sel(m.OPERATOR_OCCUPANCY.series, SEL_SERVICE), "{{inferenceservice}} occupancy"),
            q(sel(m.OPERATOR_KV_USAGE.series, SEL_SERVICE), "{{inferenceservice}} KV usage (live)"),
            q(sel(m.OPERATOR_TARGET_KV_USAGE.series, SEL_SERVICE), "{{inferenceservice}} target"),
        ), unit="percentunit",
            description="Mean occupancy (per pod the fuller of KV blocks held by live requests and "
                        "batch slots in use) and mean KV usage, against targetKVUsage."),
        Panel("Load (replicas' worth) vs desired replicas", (
            q(sel(m.OPERATOR_LOAD.series, SEL_SERVICE), "{{inferenceservice}} load"),
            q(sel(m.OPERATOR_DESIRED.series, SEL_SERVICE), "{{inferenceservice}} desired"),
        ), description=LOAD_RULE),
        Panel("Queued prefill seconds vs target", (
            q(sel(m.OPERATOR_PREFILL_SECONDS.series, SEL_SERVICE), "{{inferenceservice}} prefill queued"),
            q(sel(m.OPERATOR_TARGET_PREFILL_SECONDS.series, SEL_SERVICE),
              "{{inferenceservice}} target"),
        ), unit="s",
            description="The load's second measure: seconds of prompt work queued over all pods "
                        "(per pod kvscale:prefill_tokens_waiting / its measured "
                        "kvscale:prefill_tokens_per_s), against targetPrefillSeconds; each "
                        "targetPrefillSeconds of it asks for one replica."),
        Panel("Waiting requests: autoscaler view vs target", (
            q(sel(m.OPERATOR_WAITING.series, SEL_SERVICE), "{{inferenceservice}} waiting"),
            q(sel(m.OPERATOR_TARGET_QUEUE.series, SEL_SERVICE), "{{inferenceservice}} target"),
        )),
        Panel("Replicas: desired / current / ready", (
            q(sel(m.OPERATOR_DESIRED.series, SEL_SERVICE), "{{inferenceservice}} desired"),
            q(sel(m.OPERATOR_CURRENT.series, SEL_SERVICE), "{{inferenceservice}} current"),
            q(sel(m.OPERATOR_READY.series, SEL_SERVICE), "{{inferenceservice}} ready"),
            q(sel(m.OPERATOR_MAX.series, SEL_SERVICE), "{{inferenceservice}} max"),
        )),
        Panel("Scale decisions", (
            q(f"sum by (direction, reason) (increase("
              f"{sel(m.OPERATOR_SCALE_DECISIONS.series, SEL_SERVICE)}[{RATE}]))",
              "{{direction}} ({{reason}})"),
        ), bars=True),
        Panel("Panic mode", (
            q(sel(m.OPERATOR_PANIC.series, SEL_SERVICE), "{{inferenceservice}} panic"),
        ), description="1 while a burst keeps the autoscaler from scaling down."),
        Panel("KV blocks per pod: active / cached / total", (
            q(sel(m.KV_BLOCKS_ACTIVE.series, SEL_SERVER), "{{pod}} active"),
            q(sel(m.KV_BLOCKS_CACHED.series, SEL_SERVER), "{{pod}} cached"),
            q(sel(m.KV_BLOCKS_TOTAL.series, SEL_SERVER), "{{pod}} total"),
        )),
        Panel("Running and waiting requests per pod", (
            q(sel(m.NUM_REQUESTS_RUNNING.series, SEL_SERVER), "{{pod}} running"),
            q(sel(m.NUM_REQUESTS_WAITING.series, SEL_SERVER), "{{pod}} waiting"),
        )),
        Panel("Queue's effect on TTFT (p90)", (
            q(quantile(0.9, m.TTFT, SEL_SERVER), "TTFT p90"),
            q(quantile(0.9, m.QUEUE_TIME, SEL_SERVER), "queue time p90"),
        ), unit="s"),
        Panel("Scale from zero: requests held", (
            q(sel(m.OPERATOR_HELD_REQUESTS.series, SEL_SERVICE), "{{inferenceservice}} held (operator)"),
            q(f"sum by (inferenceservice) ({sel(m.ROUTER_HELD_REQUESTS.series, SEL_SERVICE)})",
              "{{inferenceservice}} held (routers)"),
            q(f"sum by (outcome) (increase({sel(m.ROUTER_HOLDS.series, SEL_SERVICE)}[{RATE}]))",
              "holds ended: {{outcome}}"),
        ), description="minReplicas 0: requests the routers hold while no replica is ready, and "
                       "how their holds ended (timeout and full are 503s)."),
        Panel("Scale from zero: cold start", (
            q(sel(m.OPERATOR_COLD_START_SECONDS.series, SEL_SERVICE), "{{inferenceservice}} last cold start"),
            q(quantile(0.9, m.ROUTER_HOLD_SECONDS, SEL_SERVICE), "hold time p90"),
        ), unit="s", description="From the first held request to a ready replica (the activation), "
                                 "and how long requests were held."),
    ),
)

# ------------------------------------------------------------------------------------ Serving
SERVING = Board(
    uid="kvscale-serving",
    title="kvscale / Serving",
    description="Throughput, latency, prefix caching and errors of the kvscale serve replicas.",
    pod_source=m.NUM_REQUESTS_RUNNING.series,
    panels=(
        Panel("Tokens/s in and out", (
            q(f"sum({rate(m.PROMPT_TOKENS.series, SEL_SERVER)})", "prompt tokens/s"),
            q(f"sum({rate(m.GENERATION_TOKENS.series, SEL_SERVER)})", "generated tokens/s"),
        )),
        Panel("Time to first token", tuple(
            q(quantile(p, m.TTFT, SEL_SERVER), f"p{int(p * 100)}") for p in (0.5, 0.9, 0.99)
        ), unit="s"),
        Panel("Inter-token latency", tuple(
            q(quantile(p, m.ITL, SEL_SERVER), f"p{int(p * 100)}") for p in (0.5, 0.9, 0.99)
        ), unit="s"),
        Panel("End-to-end latency", tuple(
            q(quantile(p, m.E2E_LATENCY, SEL_SERVER), f"p{int(p * 100)}") for p in (0.5, 0.9, 0.99)
        ), unit="s"),
        Panel("Prefix-cache hit rate", (
            q(f"sum({rate(m.PREFIX_CACHE_HITS.series, SEL_SERVER)}) / "
              f"sum({rate(m.PREFIX_CACHE_QUERIES.series, SEL_SERVER)})", "hit rate"),
        ), unit="percentunit", description="Prompt tokens found cached / looked up, over the window."),
        Panel("KV cache usage per pod", (
            q(sel(m.KV_CACHE_USAGE.series, SEL_SERVER), "{{pod}}"),
        ), unit="percentunit"),
        Panel("Preemptions and KV evictions", (
            q(f"sum by (pod) ({rate(m.NUM_PREEMPTIONS.series, SEL_SERVER)})", "{{pod}} preemptions/s"),
            q(f"sum by (pod) ({rate(m.KV_BLOCKS_EVICTED.series, SEL_SERVER)})",
              "{{pod}} evicted blocks/s"),
        )),
        Panel("Host KV tier: blocks", (
            q(f"sum by (pod) ({sel(m.KV_HOST_BLOCKS_CACHED.series, SEL_SERVER)})", "{{pod}} cached"),
            q(f"sum by (pod) ({sel(m.KV_HOST_BLOCKS_TOTAL.series, SEL_SERVER)})", "{{pod}} total"),
        ), description="Blocks of the second KV tier (--kv-offloading-size) holding a prefix block."),
        Panel("Host KV tier: demotions, promotions, swaps", (
            q(f"sum by (pod) ({rate(m.KV_BLOCKS_DEMOTED.series, SEL_SERVER)})", "{{pod}} demoted blocks/s"),
            q(f"sum by (pod) ({rate(m.KV_BLOCKS_PROMOTED.series, SEL_SERVER)})", "{{pod}} promoted blocks/s"),
            q(f"sum by (pod) ({rate(m.KV_PREEMPTIONS_SWAPPED.series, SEL_SERVER)})", "{{pod}} swapped preemptions/s"),
        )),
        Panel("Host KV tier: hit rate and copy bandwidth", (
            q(f"sum({rate(m.EXTERNAL_PREFIX_CACHE_HITS.series, SEL_SERVER)}) / "
              f"sum({rate(m.EXTERNAL_PREFIX_CACHE_QUERIES.series, SEL_SERVER)})", "tier-2 hit rate"),
            q(f"sum by (transfer_type) ({rate(m.KV_OFFLOAD_BYTES.series, SEL_SERVER)}) / "
              f"sum by (transfer_type) ({rate(m.KV_OFFLOAD_TIME.series, SEL_SERVER)})",
              "{{transfer_type}} bytes per copy second"),
        ), description="Tokens found in the host tier / looked up there (a fraction); copy bytes per "
                       "second spent copying (bytes/s)."),
        Panel("Host KV tier: restore latency", tuple(
            q(quantile(p, m.KV_RESTORE_SECONDS, SEL_SERVER), f"p{int(p * 100)}") for p in (0.5, 0.9, 0.99)
        ), unit="s", description="One step's batch of promotions, host tier to KV cache."),
        Panel("Finish reasons", (
            q(f"sum by (finished_reason) ({rate(m.REQUEST_SUCCESS.series, SEL_SERVER)})",
              "{{finished_reason}}"),
        ), unit="reqps", bars=True),
        Panel("Errors by status", (
            q(f"sum by (status, route) "
              f"({rate(m.HTTP_REQUESTS.series, SEL_SERVER, NOT_2XX)})",
              "{{status}} {{route}}"),
        ), unit="reqps", width=24),
        Panel("Structured outputs: constrained requests and refusals", (
            q(f"sum by (kind) ({rate(m.STRUCTURED_REQUESTS.series, SEL_SERVER)})", "{{kind}}"),
            q(f"sum by (reason) ({rate(m.STRUCTURED_REFUSALS.series, SEL_SERVER)})", "refused: {{reason}}"),
            q(f"sum({rate(m.TOOL_CALL_PARSE_FAILURES.series, SEL_SERVER)})", "tool-call parse failures"),
            q(f"sum({rate(m.UNKNOWN_REQUEST_FIELDS.series, SEL_SERVER)})", "unknown request fields"),
        ), unit="reqps"),
        Panel("Grammar compile time and cache hits", (
            q(quantile(0.5, m.STRUCTURED_COMPILE_SECONDS, SEL_SERVER), "compile p50"),
            q(quantile(0.99, m.STRUCTURED_COMPILE_SECONDS, SEL_SERVER), "compile p99"),
            q(f"sum({rate(m.STRUCTURED_COMPILE_CACHE_HITS.series, SEL_SERVER)}) / "
              f"(sum({rate(m.STRUCTURED_COMPILE_CACHE_HITS.series, SEL_SERVER)}) + "
              f"sum({rate(m.STRUCTURED_COMPILE_SECONDS.count, SEL_SERVER)}))", "cache hit ratio"),
        ), unit="s"),
        Panel("Grammar mask time per step", (
            q(f"sum by (pod) ({rate(m.STRUCTURED_MASK_SECONDS.series, SEL_SERVER)}) / "
              f"sum by (pod) ({rate(m.STRUCTURED_MASK_STEPS.series, SEL_SERVER)})", "{{pod}}"),
        ), unit="s"),
        Panel("Grammar fast-forward: forced share of output tokens", (
            q(f"sum by (pod) ({rate(m.STRUCTURED_FORCED_TOKENS.series, SEL_SERVER)}) / "
              f"sum by (pod) ({rate(m.GENERATION_TOKENS.series, SEL_SERVER)})", "{{pod}}"),
        ), unit="percentunit", description="Tokens appended because the grammar allowed nothing else "
                                           "(keys, punctuation), each saving a decode step, over all "
                                           "output tokens."),
    ),
)

# ------------------------------------------------------------------------------------- Router
ROUTER = Board(
    uid="kvscale-router",
    title="kvscale / Router",
    description="Where the prefix-aware router sends traffic, and how well it predicts caches.",
    pod_source=m.ROUTER_REPLICAS_HEALTHY.series,
    # The routers' own series with a model_name: the model each router tokenizes for.
    service_source=m.ROUTER_TOKENIZER_LOADED.series,
    panels=(
        Panel("Traffic per replica", (
            q(f"sum by (replica) ({rate(m.ROUTER_REQUESTS.series, SEL_ROUTER)})", "{{replica}}"),
        ), unit="reqps"),
        Panel("Requests by status", (
            q(f"sum by (status) ({rate(m.ROUTER_REQUESTS.series, SEL_ROUTER)})", "{{status}}"),
        ), unit="reqps"),
        Panel("Prefix hit rate: router's prediction vs engines' observation", (
            q(f"sum({rate(m.ROUTER_PREDICTED_HIT_TOKENS.series, SEL_ROUTER)}) / "
              f"sum({rate(m.ROUTER_PROMPT_TOKENS.series, SEL_ROUTER)})", "predicted (router)"),
            q(f"sum({rate(m.PREFIX_CACHE_HITS.series, SEL_SERVICE)}) / "
              f"sum({rate(m.PREFIX_CACHE_QUERIES.series, SEL_SERVICE)})", "observed (engines)"),
        ), unit="percentunit"),
        Panel("In-flight requests per replica", (
            q(f"sum by (replica) ({sel(m.ROUTER_IN_FLIGHT.series, SEL_ROUTER)})", "{{replica}}"),
        )),
        Panel("Spills, retries and fallbacks", (
            q(f"sum({rate(m.ROUTER_SPILLS.series, SEL_ROUTER)})", "spills/s"),
            q(f"sum by (reason) ({rate(m.ROUTER_RETRIES.series, SEL_ROUTER)})", "retry {{reason}}"),
            q(f"sum by (reason) ({rate(m.ROUTER_FALLBACKS.series, SEL_ROUTER)})",
              "fallback {{reason}}"),
        )),
        Panel("Redis health", (
            q(f"min({sel(m.ROUTER_REDIS_UP.series, SEL_ROUTER)})", "Redis up"),
            q(f"sum({rate(m.ROUTER_REDIS_ERRORS.series, SEL_ROUTER)})", "Redis errors/s"),
            q(f"min({sel(m.ROUTER_REPLICAS_HEALTHY.series, SEL_ROUTER)})", "healthy replicas"),
        )),
        Panel("Prefix index size per replica", (
            q(f"max by (replica) ({sel(m.ROUTER_INDEX_BLOCKS.series, SEL_ROUTER)})", "{{replica}}"),
        )),
        Panel("Routing decision latency", tuple(
            q(quantile(p, m.ROUTER_DECISION_SECONDS, SEL_ROUTER), f"p{int(p * 100)}")
            for p in (0.5, 0.99)
        ), unit="s"),
    ),
)

BOARDS = {"autoscaling": AUTOSCALING, "serving": SERVING, "router": ROUTER}


def variables(board: Board) -> g.Templating:
    def label_var(name: str, series: str, selector: str) -> g.Template:
        return g.Template(
            name=name, label=name, dataSource=DS, query=f"label_values({series}{{{selector}}}, {name})",
            includeAll=True, multi=True, allValue=".*", refresh=2, sort=1,
            default="$__all")

    source = board.service_source
    return g.Templating(list=[
        g.Template(name="datasource", label="Data source", type="datasource", query="prometheus",
                   default="default"),
        label_var("namespace", source, ""),
        label_var("inferenceservice", source, 'namespace=~"$namespace"'),
        label_var("model_name", source, SEL_SERVICE),
        label_var("pod", board.pod_source, SEL_SERVICE),
    ])


def build(board: Board) -> dict:
    panels = []
    x = y = 0
    for i, panel in enumerate(board.panels):
        if x + panel.width > 24:
            x, y = 0, y + 8
        targets = [g.Target(expr=query.expr, legendFormat=query.legend, refId=chr(ord("A") + j),
                            datasource=DS)
                   for j, query in enumerate(panel.queries)]
        panels.append(g.TimeSeries(
            title=panel.title, description=panel.description, dataSource=DS, targets=targets,
            unit=panel.unit, id=i + 1, gridPos=g.GridPos(h=8, w=panel.width, x=x, y=y),
            drawStyle="bars" if panel.bars else "line", fillOpacity=60 if panel.bars else 10,
            legendDisplayMode="list", legendPlacement="bottom"))
        x += panel.width
    annotations = g.Annotations(list=[
        {"name": name, "datasource": DS, "enable": True, "expr": expr, "iconColor": "orange",
         "titleFormat": "scaled {{direction}}", "textFormat": "{{inferenceservice}}: {{reason}}",
         "useValueForTime": False, "step": "30s"}
        for name, expr in board.annotations])
    dashboard = g.Dashboard(
        title=board.title, uid=board.uid, description=board.description, tags=["kvscale"],
        panels=panels, templating=variables(board), annotations=annotations, refresh="30s",
        time=g.Time("now-1h", "now"), timezone="browser", editable=True, graphTooltip=1,
    ).auto_panel_ids()
    return json.loads(json.dumps(dashboard.to_json_data(), cls=DashboardEncoder))


# -------------------------------------------------------------------------------------- Rules
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


def rendered() -> dict[Path, str]:
    out = {DASHBOARD_DIR / f"{name}.json": json.dumps(build(board), indent=2, sort_keys=True) + "\n"
           for name, board in BOARDS.items()}
    out[RULES_FILE] = ("# Generated by tools/gen_observability.py; edit that, then `make dashboards`.\n"
                       + yaml.safe_dump(rules(), sort_keys=False, width=120))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for path, text in rendered().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("stale (run `make dashboards`): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
