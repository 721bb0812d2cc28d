"""Every shipped recording rule and alert against series written by hand, with `promtool test
rules` (Debian's prometheus package): what each records, when each alert fires, and the cases
where an alert used to lie: a service scaled by hand past four replicas is not
"at its max", and a pod loading its model for the first time is not a scrape failure.

The test file is written here from the rules' own definitions (tools/observability_rules.py), so
the expected summaries are the shipped ones; a rule without a case fails the test.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from gen_observability import RULES_FILE  # noqa: E402
from observability_rules import ALERTS, RECORDING  # noqa: E402

SERVICE = {"namespace": "team", "inferenceservice": "chat", "model_name": "m"}
SERVICE_SERIES = 'namespace="team", inferenceservice="chat", model_name="m"'


def summary(alert: str, labels: dict[str, str]) -> str:
    text = next(a.summary for a in ALERTS if a.name == alert)
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)


def fires(alert: str, at: str, *label_sets: dict[str, str]) -> dict[str, Any]:
    severity = next(a.severity for a in ALERTS if a.name == alert)
    return {"eval_time": at, "alertname": alert, "exp_alerts": [
        {"exp_labels": {**labels, "severity": severity},
         "exp_annotations": {"summary": summary(alert, labels)}} for labels in label_sets]}


RECORDED = [
    {"expr": 'kvscale:kv_cache_usage:max{inferenceservice="chat"}', "eval_time": "5m",
     "exp_samples": [{"labels": f"kvscale:kv_cache_usage:max{{{SERVICE_SERIES}}}", "value": 0.6}]},
    {"expr": 'kvscale:num_requests_waiting:sum{inferenceservice="chat"}', "eval_time": "5m",
     "exp_samples": [{"labels": f"kvscale:num_requests_waiting:sum{{{SERVICE_SERIES}}}", "value": 7}]},
    {"expr": "kvscale:prefix_cache_hit_rate:rate5m", "eval_time": "10m",
     "exp_samples": [{"labels": f"kvscale:prefix_cache_hit_rate:rate5m{{{SERVICE_SERIES}}}",
                      "value": 0.5}]},
    {"expr": "kvscale:time_to_first_token_seconds:p90_rate5m", "eval_time": "10m",
     "exp_samples": [{"labels": f"kvscale:time_to_first_token_seconds:p90_rate5m{{{SERVICE_SERIES}}}",
                      "value": 0.1}]},
    {"expr": "kvscale:generation_tokens:rate5m", "eval_time": "10m",
     "exp_samples": [{"labels": f"kvscale:generation_tokens:rate5m{{{SERVICE_SERIES}}}", "value": 1}]},
    {"expr": "kvscale_router:predicted_prefix_hit_rate:rate5m", "eval_time": "10m",
     "exp_samples": [{"labels": 'kvscale_router:predicted_prefix_hit_rate:rate5m{namespace="team", '
                                'inferenceservice="chat"}', "value": 0.5}]},
]

SERIES = [
    # Servers of `chat` (two pods), and a busy service `hot` whose cache stays saturated.
    {"series": f'vllm:kv_cache_usage_perc{{{SERVICE_SERIES}, pod="a"}}', "values": "0.2x30"},
    {"series": f'vllm:kv_cache_usage_perc{{{SERVICE_SERIES}, pod="b"}}', "values": "0.6x30"},
    {"series": 'vllm:kv_cache_usage_perc{namespace="team", inferenceservice="hot", model_name="m", pod="c"}',
     "values": "0.99x30"},
    {"series": f'vllm:num_requests_waiting{{{SERVICE_SERIES}, pod="a"}}', "values": "3x30"},
    {"series": f'vllm:num_requests_waiting{{{SERVICE_SERIES}, pod="b"}}', "values": "4x30"},
    {"series": 'vllm:num_requests_waiting{namespace="team", inferenceservice="hot", model_name="m", pod="c"}',
     "values": "0+5x30"},  # 5 more waiting every minute: growing
    {"series": f'vllm:prefix_cache_hits_total{{{SERVICE_SERIES}, pod="a"}}', "values": "0+30x30"},
    {"series": f'vllm:prefix_cache_queries_total{{{SERVICE_SERIES}, pod="a"}}', "values": "0+60x30"},
    {"series": f'vllm:time_to_first_token_seconds_bucket{{{SERVICE_SERIES}, pod="a", le="0.1"}}',
     "values": "0+9x30"},
    {"series": f'vllm:time_to_first_token_seconds_bucket{{{SERVICE_SERIES}, pod="a", le="1"}}',
     "values": "0+10x30"},
    {"series": f'vllm:time_to_first_token_seconds_bucket{{{SERVICE_SERIES}, pod="a", le="+Inf"}}',
     "values": "0+10x30"},
    {"series": f'vllm:generation_tokens_total{{{SERVICE_SERIES}, pod="a"}}', "values": "0+60x30"},
    # Its router: predictions, and fallbacks on one router pod.
    {"series": 'kvscale_router_predicted_prefix_hit_tokens_total{namespace="team", inferenceservice="chat", pod="r"}',
     "values": "0+30x30"},
    {"series": 'kvscale_router_prompt_tokens_total{namespace="team", inferenceservice="chat", pod="r"}',
     "values": "0+60x30"},
    {"series": 'kvscale_router_fallbacks_total{namespace="team", inferenceservice="chat", pod="r", reason="redis_down"}',
     "values": "0+10x30"},
    # Scale from zero: `chat`'s router released every held request; `cold`'s timed one out at
    # minute 12 (and a client of `chat` went away: not a failure).
    {"series": 'kvscale_router_holds_total{namespace="team", inferenceservice="chat", pod="r", outcome="released"}',
     "values": "0+2x30"},
    {"series": 'kvscale_router_holds_total{namespace="team", inferenceservice="chat", pod="r", outcome="disconnected"}',
     "values": "0x10 1x20"},
    {"series": 'kvscale_router_holds_total{namespace="team", inferenceservice="cold", pod="s", outcome="timeout"}',
     "values": "0x12 1x18"},
    # The operator: `auto` autoscales and wants its max; `manual` is scaled by hand to 5 and,
    # with autoscaling off, exports no max (operator/metrics.py).
    {"series": 'kvscale_operator_desired_replicas{namespace="team", inferenceservice="auto"}', "values": "4x30"},
    {"series": 'kvscale_operator_max_replicas{namespace="team", inferenceservice="auto"}', "values": "4x30"},
    {"series": 'kvscale_operator_desired_replicas{namespace="team", inferenceservice="manual"}', "values": "5x30"},
    # Scrapes: pod `a` was up and went down at minute 10; pod `new` is loading its model and
    # was never up.
    {"series": 'up{namespace="team", inferenceservice="chat", pod="a"}', "values": "1x10 0x20"},
    {"series": 'up{namespace="team", inferenceservice="chat", pod="new"}', "values": "0x30"},
]

ALERT_CASES = [
    fires("KVScaleKVCacheSaturated", "4m"),  # not yet: 5 minutes of it
    fires("KVScaleKVCacheSaturated", "10m",
          {"namespace": "team", "inferenceservice": "hot", "model_name": "m"}),
    fires("KVScaleQueueGrowing", "25m", {"namespace": "team", "inferenceservice": "hot", "model_name": "m"}),
    fires("KVScaleRouterInFallback", "20m", {"namespace": "team", "pod": "r"}),
    # `manual` (5 replicas by hand) never appears; `auto` does after 15 minutes at its max.
    fires("KVScaleAutoscalerAtMaxReplicas", "20m", {"namespace": "team", "inferenceservice": "auto"}),
    fires("KVScaleActivationRefusing", "11m"),
    fires("KVScaleActivationRefusing", "14m", {"namespace": "team", "inferenceservice": "cold"}),
    fires("KVScaleActivationRefusing", "29m"),  # ten minutes later: quiet again
    # `new`, loading for 30 minutes, never fires; `a` does 5 minutes after it stopped answering.
    fires("KVScaleReplicaNotScraped", "12m"),
    fires("KVScaleReplicaNotScraped", "20m", {"namespace": "team", "inferenceservice": "chat", "pod": "a"}),
    fires("KVScaleReplicaNotScraped", "30m", {"namespace": "team", "inferenceservice": "chat", "pod": "a"}),
]


def test_every_rule_has_a_case() -> None:
    assert {r["expr"].split("{")[0] for r in RECORDED} == {name for name, _ in RECORDING}
    assert {c["alertname"] for c in ALERT_CASES} == {a.name for a in ALERTS}


def test_promtool_passes_every_case(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: make system-deps installs Debian's prometheus"
    shutil.copy(RULES_FILE, tmp_path / "rules.yaml")
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": SERIES, "promql_expr_test": RECORDED,
         "alert_rule_test": ALERT_CASES}]}
    (tmp_path / "rules_test.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", "rules_test.yaml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
