"""The chart ships the generated dashboards, rules and scrape configuration as they are committed:
rendered with the real helm (tools/k8s-bins.sh builds it) and compared with the files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from observability_helpers import CHART, committed_dashboards, committed_rules  # noqa: E402

ALL_ON = ("observability.dashboards.enabled=true", "observability.podMonitors.enabled=true",
          "observability.prometheusRule.enabled=true")


@pytest.fixture(scope="module")
def render(k8s_bins: Path, tmp_path_factory):
    helm = k8s_bins / "helm"
    assert os.access(helm, os.X_OK), f"no helm in {k8s_bins} (tools/k8s-bins.sh builds it)"
    home = tmp_path_factory.mktemp("helm")
    env = {**os.environ, "HELM_CONFIG_HOME": str(home), "HELM_CACHE_HOME": str(home),
           "HELM_DATA_HOME": str(home)}

    def run(*values: str, api_versions: tuple[str, ...] = ("monitoring.coreos.com/v1",)) -> list[dict]:
        # `helm template` knows no cluster: say which APIs it serves, as `helm install` finds out.
        args = [str(helm), "template", "rel", str(CHART), "--namespace", "kvscale-system",
                *[f"--api-versions={api}" for api in api_versions]]
        for value in values:
            args += ["--set", value]
        proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]

    return run


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def test_off_by_default(render) -> None:
    docs = render()
    assert not of_kind(docs, "PodMonitor") and not of_kind(docs, "PrometheusRule")
    assert not [d for d in of_kind(docs, "ConfigMap")
                if d["metadata"].get("labels", {}).get("grafana_dashboard")]


def test_monitoring_kinds_only_where_the_cluster_serves_them(render) -> None:
    docs = render(*ALL_ON, api_versions=())
    assert not of_kind(docs, "PodMonitor") and not of_kind(docs, "PrometheusRule")
    assert [d for d in of_kind(docs, "ConfigMap")
            if d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    served = render(*ALL_ON)
    assert of_kind(served, "PodMonitor") and of_kind(served, "PrometheusRule")


def test_dashboards_as_configmaps_for_the_grafana_sidecar(render) -> None:
    docs = render(*ALL_ON, "observability.dashboards.namespace=grafana")
    maps = [d for d in of_kind(docs, "ConfigMap")
            if d["metadata"]["labels"].get("grafana_dashboard") == "1"]
    shipped = {}
    for cm in maps:
        assert cm["metadata"]["namespace"] == "grafana"
        (key, text), = cm["data"].items()
        shipped[key] = json.loads(text)
    assert shipped == {f"kvscale-{name}.json": board for name, board in committed_dashboards().items()}


def test_prometheus_rule_holds_the_generated_rules(render) -> None:
    rule, = of_kind(render(*ALL_ON), "PrometheusRule")
    assert rule["spec"] == committed_rules()
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"


def test_pod_monitors_label_series_as_the_dashboards_filter(render) -> None:
    docs = render(*ALL_ON)
    monitors = {d["metadata"]["name"]: d["spec"] for d in of_kind(docs, "PodMonitor")}
    servers, routers, operator = (monitors["rel-servers"], monitors["rel-routers"],
                                  monitors["rel-operator"])
    for spec, pod_label in ((servers, "inferenceservice"), (routers, "router")):
        endpoint, = spec["podMetricsEndpoints"]
        assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
        assert endpoint["relabelings"] == [{
            "sourceLabels": [f"__meta_kubernetes_pod_label_serving_kvscale_io_{pod_label}"],
            "targetLabel": "inferenceservice"}]
        assert spec["namespaceSelector"] == {"any": True}
    # The operator's series carry namespace/inferenceservice themselves.
    endpoint, = operator["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is True
    deployment = next(d for d in of_kind(docs, "Deployment")
                      if d["metadata"]["labels"].get("app.kubernetes.io/component") == "operator")
    pod = deployment["spec"]["template"]
    assert operator["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    container = pod["spec"]["containers"][0]
    assert endpoint["port"] in [p["name"] for p in container["ports"]]
    assert any(a.startswith("--metrics-port=") for a in container["args"])
