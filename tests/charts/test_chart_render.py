"""The chart rendered by the real helm: lint, schema, pod security, the contracts it shares with
the operator and the router, and deploy/*.yaml kept identical to what it renders."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from chart_helpers import ALL_ON, CHART, REPO_ROOT

from kvscale.operator.children.labels import child_labels, redis_labels, router_labels
from kvscale.operator.children.namespace_router import NamespaceRouterValues
from kvscale.operator.render_router import render_plain
from kvscale.operator.spec import REDIS_PORT, SERVER_PORT, RedisSource, SecretKeyRef
from kvscale.router.policy import DEFAULT_POLICY, POLICIES

# Kubernetes' own structures inside values: their parts are optional.
OPEN_BLOCKS = {"resources", "namespaceSelector", "podSelector"}
# Fast once helm is built, but helm comes with the Go-built control plane (tools/k8s-bins.sh), which
# `make test-fast` on a clean clone should not wait for.
pytestmark = pytest.mark.slow

POD_KINDS = {"Deployment": lambda d: d["spec"]["template"]["spec"], "Pod": lambda d: d["spec"]}


def test_helm_lint(helm):
    for values in ((), ALL_ON):
        args = ["lint", str(CHART), "--strict"]
        for value in values:
            args += ["--set", value]
        result = helm.run(*args, check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "0 chart(s) failed" in result.stdout


def test_deploy_files_are_rendered_from_the_chart(helm):
    """deploy/*.yaml, the chart's copy of crds/ and its namespace-router template (from the
    operator's router builders) are exactly what `make deploy-render` writes."""
    result = subprocess.run(["bash", str(REPO_ROOT / "tools" / "render-deploy.sh"), "--check"],
                            capture_output=True, text=True,
                            env={"HELM": str(helm.binary), "PYTHON": sys.executable,
                                 "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    rbac = list(yaml.safe_load_all((REPO_ROOT / "deploy" / "rbac.yaml").read_text()))
    kinds = [d["kind"] for d in rbac if d]
    assert kinds[0] == "Namespace"  # applied first, so the rest has somewhere to go
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"} <= set(kinds)
    operator = [d for d in yaml.safe_load_all((REPO_ROOT / "deploy" / "operator.yaml").read_text()) if d]
    assert {d["kind"] for d in operator} == {"Deployment", "PodDisruptionBudget"}


def test_defaults_render_the_operator_and_the_crd_kept_on_uninstall(helm):
    docs = helm.template()
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    crd = by_kind[("CustomResourceDefinition", "inferenceservices.serving.kvscale.io")]
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert crd["spec"] == yaml.safe_load((REPO_ROOT / "crds" / "inferenceservice.yaml").read_text())["spec"]

    operator = by_kind[("Deployment", "kvscale-operator")]
    assert operator["spec"]["replicas"] == 2
    container = operator["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/kvscale/kvscale-control-plane:0.1.0"  # appVersion
    args = container["args"]
    assert args[0] == "operator"
    assert "--leader-elect" in args and "--leader-election-id=kvscale-operator" in args
    assert "--router-image=ghcr.io/kvscale/kvscale-control-plane:0.1.0" in args
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] == "metrics"
    assert ("PodDisruptionBudget", "kvscale-operator") in by_kind
    # The Lease the operator campaigns for is the one its Role lets it update.
    role = by_kind[("Role", "kvscale-operator-leader-election")]
    assert ["kvscale-operator"] in [r.get("resourceNames") for r in role["rules"]]
    # Nothing optional by default, no test pods, no `latest` anywhere.
    kinds = {d["kind"] for d in docs}
    assert "NetworkPolicy" not in kinds and "Pod" not in kinds and "ConfigMap" not in kinds
    assert ":latest" not in json.dumps(docs)


def test_every_pod_meets_the_restricted_pod_security_standard(helm):
    docs = helm.template(*ALL_ON)
    pods = [(d["metadata"]["name"], POD_KINDS[d["kind"]](d)) for d in docs if d["kind"] in POD_KINDS]
    assert len(pods) == 4  # operator, namespace router, two helm test pods
    for name, spec in pods:
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in spec["containers"]:
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["capabilities"] == {"drop": ["ALL"]}, name
            assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"], name
            assert "resources" in container, name


def test_network_policies_select_what_the_operator_creates(helm):
    """Selectors and ports come from the operator's own label and port definitions."""
    docs = helm.template(*ALL_ON)
    policies = {(d["metadata"]["namespace"], d["metadata"]["name"]): d
                for d in docs if d["kind"] == "NetworkPolicy"}
    # Every kvscale pod's ingress said outright (test_chart_networkpolicies.py: who reaches whom).
    assert set(policies) == {(ns, f"kvscale-{part}") for ns in ("default", "kvscale-system")
                             for part in ("redis", "servers", "client-facing-servers", "pool-servers",
                                          "ranks", "routers")
                             } | {("kvscale-system", "kvscale-router")}

    def selects(selector: dict, labels: dict) -> bool:
        return selector.get("matchLabels", {}).items() <= labels.items() and all(
            labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))

    servers, redis = policies[("default", "kvscale-servers")], policies[("default", "kvscale-redis")]
    assert selects(servers["spec"]["podSelector"], child_labels("chat"))
    assert not selects(servers["spec"]["podSelector"], router_labels("chat"))
    assert selects(redis["spec"]["podSelector"], redis_labels("chat"))
    assert servers["spec"]["ingress"][0]["ports"] == [{"port": SERVER_PORT, "protocol": "TCP"}]
    assert redis["spec"]["ingress"][0]["ports"] == [{"port": REDIS_PORT, "protocol": "TCP"}]
    # Redis: from routers and servers only.
    peers = redis["spec"]["ingress"][0]["from"]
    assert any(selects(p["podSelector"], router_labels("chat")) for p in peers)
    assert any(selects(p["podSelector"], child_labels("chat")) for p in peers)
    assert not any(selects(p["podSelector"], {"app": "anything-else"}) for p in peers)
    # Servers: from routers, the operator (it scrapes them) and the metrics scraper's namespace.
    server_peers = servers["spec"]["ingress"][0]["from"]
    assert any(selects(p.get("podSelector", {}), router_labels("chat")) and "namespaceSelector" not in p
               for p in server_peers)
    operator = next(d for d in helm.template() if d["kind"] == "Deployment")
    operator_labels = operator["spec"]["template"]["metadata"]["labels"]
    assert any(selects(p.get("podSelector", {}), operator_labels)
               and p.get("namespaceSelector", {}).get("matchLabels") == {"kubernetes.io/metadata.name": "kvscale-system"}
               for p in server_peers)
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}} in server_peers


def test_namespace_router_runs_namespace_wide_with_least_privilege(helm):
    docs = helm.template(*ALL_ON)
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvscale-router")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[0] == "router" and "--k8s-namespace-wide" in args
    assert args[args.index("--namespace") + 1] == "kvscale-system"
    assert {"name": "KVSCALE_REDIS_URL", "value": "redis://kv-index.default.svc:6379/0"} in container["env"]
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "kvscale-router")
    for rule in role["rules"]:
        assert set(rule["verbs"]) <= {"get", "list", "watch"}  # it only reads
    # Its --policy choices are the router's.
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["namespaceRouter"]["properties"]["policy"]["enum"] == list(POLICIES)
    assert yaml.safe_load((CHART / "values.yaml").read_text())["namespaceRouter"]["policy"] == DEFAULT_POLICY


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ("operator.replicaz=3", "additional properties 'replicaz' not allowed"),
        ("operator.replicas=two", "got string, want integer"),
        ("namespaceRouter.policy=fastest", "namespaceRouter/policy"),
        ("operator.metricsPort=80", "operator/metricsPort"),
        ("crds.instal=false", "additional properties 'instal' not allowed"),
        # Credentials in a plain value would sit in the router's pod spec.
        ("namespaceRouter.redis.url=redis://:hunter2@r:6379/0", "namespaceRouter/redis/url"),
        # Only * and ? as wildcards: the admission policy matches them as RE2, the operator as fnmatch.
        ("operator.allowedApiKeySecrets={team-[ab]-key}", "operator/allowedApiKeySecrets/0"),
    ],
)
def test_schema_refuses_typos_and_wrong_types(helm, values, message):
    result = helm.run("template", "kvscale", str(CHART), "--set", values, check=False)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert message in result.stderr


def test_a_values_file_with_a_typo_is_refused(helm, tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text("operator:\n  replicas: 2\n  leaderElection:\n    enable: true\n")
    result = helm.run("template", "kvscale", str(CHART), "-f", str(values), check=False)
    assert result.returncode != 0
    assert "at '/operator/leaderElection': additional properties 'enable' not allowed" in result.stderr


def test_latest_and_unsafe_combinations_are_refused(helm):
    result = helm.run("template", "kvscale", str(CHART), "--set", "images.controlPlane.tag=latest",
                      check=False)
    assert result.returncode != 0 and "pin a version" in result.stderr
    result = helm.run("template", "kvscale", str(CHART), "--set",
                      "operator.leaderElection.enabled=false", check=False)
    assert result.returncode != 0 and "would fight" in result.stderr
    docs = helm.template("operator.leaderElection.enabled=false", "operator.replicas=1")
    operator = next(d for d in docs if d["kind"] == "Deployment")
    assert "--no-leader-elect" in operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(d["kind"] == "Role" for d in docs)


def test_values_yaml_and_schema_describe_the_same_keys():
    """Every key the schema allows appears, with its default, in values.yaml (the documented file
    users read), and every top-level section there opens with a comment."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())

    def keys(node: dict, prefix: str = "") -> set[str]:
        found = set()
        for key, child in node.items():
            found.add(prefix + key)
            # Kubernetes' own blocks (resources, label selectors): any part may be left out.
            if isinstance(child, dict) and "properties" in child and key not in OPEN_BLOCKS:
                found |= keys(child["properties"], f"{prefix}{key}.")
        return found

    def value_keys(node: dict, schema_node: dict, prefix: str = "") -> set[str]:
        found = set()
        for key, child in node.items():
            found.add(prefix + key)
            sub = schema_node.get(key, {})
            if isinstance(child, dict) and "properties" in sub and key not in OPEN_BLOCKS:
                found |= value_keys(child, sub["properties"], f"{prefix}{key}.")
        return found

    assert keys(schema["properties"]) == value_keys(values, schema["properties"])
    lines = (CHART / "values.yaml").read_text().splitlines()
    for index, line in enumerate(lines):
        if line and not line.startswith((" ", "#")):
            assert lines[index - 1].startswith("#"), f"values.yaml: {line!r} has no comment above"


HELM_ONLY_LABELS = ("app.kubernetes.io/version", "app.kubernetes.io/part-of",
                    "app.kubernetes.io/managed-by", "helm.sh/chart")


def _without_chart_extras(obj: dict) -> dict:
    """The labels Helm adds to every object of the chart, and the image pull policy, dropped."""
    obj = json.loads(json.dumps(obj))
    for meta in (obj["metadata"], obj.get("spec", {}).get("template", {}).get("metadata", {})):
        for label in HELM_ONLY_LABELS:
            meta.get("labels", {}).pop(label, None)
    for container in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
        container.pop("imagePullPolicy", None)
    return obj


@pytest.mark.parametrize("redis", ["none", "url", "secret"])
def test_the_charts_namespace_router_is_what_render_router_prints(helm, redis):
    """The chart's template and `kvscale operator render-router` agree object for object for the
    same values: the chart's copy of the router cannot drift from the operator's builders."""
    sets = ["namespaceRouter.enabled=true", "namespaceRouter.namespace=team",
            "namespaceRouter.replicas=3", "namespaceRouter.policy=round-robin",
            "namespaceRouter.apiKeySecret.name=llm-key"]
    source = RedisSource()
    if redis == "url":
        sets.append("namespaceRouter.redis.url=redis://kv.team.svc:6379/0")
        source = RedisSource(url="redis://kv.team.svc:6379/0")
    elif redis == "secret":
        sets.append("namespaceRouter.redis.existingSecret.name=kv-url")
        source = RedisSource(secret_ref=SecretKeyRef("kv-url", "url"))
    charted = helm.template(*sets, show_only=["templates/namespace-router.yaml"])
    printed = [d for d in yaml.safe_load_all(render_plain(NamespaceRouterValues(
        namespace="team", replicas=3, policy="round-robin", redis=source,
        api_key_secret=SecretKeyRef("llm-key"), image="ghcr.io/kvscale/kvscale-control-plane:0.1.0",
    ))) if d]
    # Helm orders objects by kind for installing; render-router in the order it builds them.
    assert ({d["kind"]: _without_chart_extras(d) for d in charted}
            == {d["kind"]: d for d in printed})
    assert len(charted) == len(printed) == 6
