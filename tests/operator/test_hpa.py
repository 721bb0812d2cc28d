"""The external-HPA builders (operator/hpa.py); the chain itself runs in test_platform_hpa.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvscale import metric_names as names
from kvscale.operator import hpa

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_adapter_rule_reads_vllm_running_and_waiting_per_pod_and_per_service() -> None:
    (rule,) = hpa.adapter_rules()["rules"]
    running, waiting = names.NUM_REQUESTS_RUNNING.series, names.NUM_REQUESTS_WAITING.series
    assert running in rule["seriesQuery"] and 'pod!=""' in rule["seriesQuery"]
    assert rule["name"] == {"matches": f"^{running}$", "as": hpa.CONCURRENCY_METRIC}
    assert f'{{__name__=~"{running}|{waiting}",<<.LabelMatchers>>}}' in rule["metricsQuery"]
    assert rule["metricsQuery"].startswith("sum by (<<.GroupBy>>)")
    overrides = rule["resources"]["overrides"]
    assert overrides["pod"] == {"resource": "pods"}
    assert overrides[hpa.INFERENCE_SERVICE_LABEL] == {"group": "serving.kvscale.io",
                                                      "resource": "inferenceservices"}
    # The custom metrics API puts the name in a URL path: no ':' (vLLM's names have one).
    assert ":" not in hpa.CONCURRENCY_METRIC


def test_the_hpa_targets_the_scale_subresource_on_average_concurrency() -> None:
    manifest = hpa.horizontal_pod_autoscaler("chat", "team", min_replicas=1, max_replicas=4,
                                             target_concurrency=1.5)
    spec = manifest["spec"]
    crd = yaml.safe_load((REPO_ROOT / "crds" / "inferenceservice.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["storage"])
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert spec["scaleTargetRef"] == {"apiVersion": f"{crd['spec']['group']}/{version['name']}",
                                      "kind": crd["spec"]["names"]["kind"], "name": "chat"}
    (metric,) = spec["metrics"]
    assert metric == {"type": "Pods", "pods": {"metric": {"name": hpa.CONCURRENCY_METRIC},
                                               "target": {"type": "AverageValue", "averageValue": "1500m"}}}
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300  # HPA's default
    assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 4)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"min_replicas": 0, "max_replicas": 2, "target_concurrency": 2}, "minReplicas"),
    ({"min_replicas": 3, "max_replicas": 2, "target_concurrency": 2}, "maxReplicas"),
    ({"min_replicas": 1, "max_replicas": 2, "target_concurrency": 0}, "positive"),
])
def test_the_hpa_refuses_what_the_api_would(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        hpa.horizontal_pod_autoscaler("chat", "team", **kwargs)


@pytest.mark.parametrize(("value", "text"), [(2, "2"), (1.5, "1500m"), (0.25, "250m"), (0.001, "1m")])
def test_quantity(value: float, text: str) -> None:
    assert hpa.quantity(value) == text


def test_quantity_refuses_what_it_cannot_write() -> None:
    with pytest.raises(ValueError):
        hpa.quantity(0.0001)


def _hpa(name: str, kind: str = "InferenceService", target: str = "chat",
         api_version: str = "serving.kvscale.io/v1alpha1") -> dict:
    return {"metadata": {"name": name},
            "spec": {"scaleTargetRef": {"apiVersion": api_version, "kind": kind, "name": target}}}


def test_only_hpas_on_this_inference_service_count() -> None:
    hpas = [_hpa("b"), _hpa("a"), _hpa("other", target="other"), _hpa("deploy", kind="Deployment"),
            _hpa("alien", api_version="example.com/v1"), {"metadata": {"name": "empty"}, "spec": {}}]
    assert hpa.targeting(hpas, "chat") == ["a", "b"]
    assert hpa.targeting([], "chat") == []


def test_the_conflict_condition_says_what_to_do() -> None:
    condition = hpa.external_autoscaler_condition(["chat"])
    assert (condition.type, condition.status, condition.reason) == ("ScalingActive", False,
                                                                    "ExternalAutoscaler")
    assert condition.message.startswith("HorizontalPodAutoscaler chat also scale")
    assert "set spec.autoscaling.enabled to false" in condition.message
    assert "delete the HPA" in condition.message
