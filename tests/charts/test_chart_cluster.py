"""The chart on the real kube-apiserver (the session's k8s_env): every rendered manifest accepted by
a server-side dry run, and a release's whole life: install, the operator from the chart
reconciling an InferenceService under the chart's own ServiceAccount, upgrades, uninstall."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from chart_helpers import ALL_ON, CHART, Helm
from testenv import kwok_toleration

from kvscale.processes import die_with_parent, free_port, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.k8s]

# Not the names deploy/*.yaml uses, so the operator tests' kubectl-applied objects never clash.
RELEASE = "kvs-chart"
NAMESPACE = "kvscale-chart"
WORKLOADS = "chart-workloads"
FULLNAME = "kvs-chart-kvscale"
OPERATOR = f"{FULLNAME}-operator"
CRD = "inferenceservices.serving.kvscale.io"
# Every kind the chart can create; after uninstall none may carry the release's label.
CHART_KINDS = ("deployments", "services", "serviceaccounts", "roles", "rolebindings",
               "poddisruptionbudgets", "networkpolicies", "configmaps", "pods", "leases",
               "clusterroles", "clusterrolebindings")


@pytest.fixture(scope="module")
def chelm(helm, k8s_env) -> Helm:
    return Helm(helm.binary, k8s_env.kubeconfig)


def _ensure_namespace(env, name: str) -> None:
    if env.kubectl("get", "namespace", name, check=False).returncode != 0:
        env.kubectl("create", "namespace", name)


@pytest.mark.parametrize("values", [(), ALL_ON], ids=["defaults", "all-optional-parts"])
def test_every_rendered_manifest_passes_a_server_side_dry_run(helm, k8s_env, values):
    for namespace in ("kvscale-system", "default"):
        _ensure_namespace(k8s_env, namespace)
    docs = helm.template(*values)
    assert docs
    result = k8s_env.kubectl("apply", "--dry-run=server", "-f", "-",
                             input=yaml.safe_dump_all(docs), check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("(server dry run)") == len(docs)


def _adopt_crd(env) -> None:
    """A CRD applied earlier with kubectl (the operator tests do) becomes the release's, the way a
    user moving from deploy/*.yaml to the chart adopts it."""
    if env.kubectl("get", "crd", CRD, check=False).returncode != 0:
        return
    env.kubectl("label", "crd", CRD, "app.kubernetes.io/managed-by=Helm", "--overwrite")
    env.kubectl("annotate", "crd", CRD, f"meta.helm.sh/release-name={RELEASE}",
                f"meta.helm.sh/release-namespace={NAMESPACE}", "--overwrite")


def _expand(value: str, env: dict[str, str]) -> str:
    """$(VAR) as Kubernetes expands it in args."""
    for name, val in env.items():
        value = value.replace(f"$({name})", val)
    return value


class ChartOperator:
    """The operator container of the installed Deployment, run as a local process with the
    Deployment's own args and env, authenticated by a real token of the chart's ServiceAccount."""

    def __init__(self, env, deployment: dict, log_path: Path) -> None:
        spec = deployment["spec"]["template"]["spec"]
        container = spec["containers"][0]
        token_kubeconfig = env.kubeconfig_with_token(NAMESPACE, spec["serviceAccountName"])
        pod_env = {"POD_NAME": f"{OPERATOR}-local", "POD_NAMESPACE": NAMESPACE, "POD_IP": "127.0.0.1"}
        assert container["command"] == ["kvscale"]
        self.metrics_port = free_port()
        args = [_expand(a, pod_env) for a in container["args"]]
        # The last --metrics-port wins: a free one instead of the pod's own port.
        argv = [sys.executable, "-m", "kvscale", *args, f"--kubeconfig={token_kubeconfig}",
                f"--metrics-port={self.metrics_port}"]
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **pod_env}, preexec_fn=die_with_parent)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def _inference_service(name: str) -> dict:
    return {
        "apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": WORKLOADS},
        "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"},
                 "resources": {"gpus": 1, "cpu": "1", "memory": "2Gi"},
                 "tolerations": [kwok_toleration()]},
    }


def _release_leftovers(env) -> list[str]:
    out = env.kubectl("get", ",".join(CHART_KINDS), "-A", "-l", f"app.kubernetes.io/instance={RELEASE}",
                      "-o", "name")
    return out.stdout.split()


def test_install_reconcile_upgrade_uninstall(chelm, k8s_env, tmp_path):
    env = k8s_env
    _adopt_crd(env)
    kwok = json.dumps([kwok_toleration()])
    installed = chelm.run("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace",
                          "--set-json", f"operator.tolerations={kwok}", "--wait", "--timeout", "180s")
    # NOTES.txt: a first InferenceService, its URL, a ready curl line, where the dashboards are.
    notes = installed.stdout.split("NOTES:", 1)[1]
    for expected in ("kind: InferenceService", "image: ghcr.io/kvscale/kvscale:0.1.0", "status.url",
                     "curl http://127.0.0.1:8080/v1/completions", "Dashboards:"):
        assert expected in notes, notes
    deployment = env.kubectl_json("get", "deployment", OPERATOR, "-n", NAMESPACE)
    assert deployment["spec"]["replicas"] == 2
    assert deployment["status"].get("readyReplicas") == 2  # kwok runs the pods
    crd = env.kubectl_json("get", "crd", CRD)
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    cluster_role_version = env.kubectl_json("get", "clusterrole", OPERATOR)["metadata"]["resourceVersion"]

    # The operator of the chart, under the chart's ServiceAccount, reconciles an InferenceService.
    _ensure_namespace(env, WORKLOADS)
    operator = ChartOperator(env, deployment, tmp_path / "operator.log")
    try:
        env.kubectl("apply", "-f", "-", input=yaml.safe_dump(_inference_service("chat")))

        def reconciled() -> bool:
            kvis = env.kubectl_json("get", "inferenceservice", "chat", "-n", WORKLOADS)
            conditions = {c["type"] for c in (kvis.get("status") or {}).get("conditions") or []}
            return "Ready" in conditions and bool((kvis.get("status") or {}).get("url"))

        wait_until(reconciled, 90, interval=1.0, what=f"chat reconciled; operator log:\n{operator.log()[-3000:]}")
        for kind, name in (("deployment", "chat"), ("service", "chat"), ("deployment", "chat-router")):
            assert env.kubectl("get", kind, name, "-n", WORKLOADS, check=False).returncode == 0, (kind, name)
        assert "forbidden" not in operator.log().lower()  # the chart's RBAC was enough
        lease = env.kubectl_json("get", "lease", OPERATOR, "-n", NAMESPACE)
        assert lease["spec"]["holderIdentity"] == f"{OPERATOR}-local"

        # Upgrade: a changed operator value rolls the operator; the Lease keeps its holder.
        generation = deployment["metadata"]["generation"]
        chelm.run("upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE, "--reuse-values",
                  "--set", "operator.scrapeInterval=7", "--wait", "--timeout", "180s")
        upgraded = env.kubectl_json("get", "deployment", OPERATOR, "-n", NAMESPACE)
        assert upgraded["metadata"]["generation"] == generation + 1
        assert "--scrape-interval=7" in upgraded["spec"]["template"]["spec"]["containers"][0]["args"]
        lease = env.kubectl_json("get", "lease", OPERATOR, "-n", NAMESPACE)
        assert lease["spec"]["holderIdentity"] == f"{OPERATOR}-local"
        assert env.kubectl_json("get", "clusterrole", OPERATOR)["metadata"]["resourceVersion"] == cluster_role_version

        # Upgrade: the namespace-wide router switched on; the operator is not rolled for it.
        chelm.run("upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE, "--reuse-values",
                  "--set", "namespaceRouter.enabled=true", "--set", "networkPolicies.enabled=true",
                  "--set-json", f"namespaceRouter.tolerations={kwok}", "--wait", "--timeout", "180s")
        assert env.kubectl_json("get", "deployment", OPERATOR, "-n", NAMESPACE)["metadata"]["generation"] == generation + 1
        router = env.kubectl_json("get", "deployment", f"{FULLNAME}-router", "-n", NAMESPACE)
        assert "--k8s-namespace-wide" in router["spec"]["template"]["spec"]["containers"][0]["args"]
        assert env.kubectl("get", "networkpolicy", f"{FULLNAME}-servers", "-n", NAMESPACE,
                           check=False).returncode == 0

        # A typo is refused by the schema before anything changes.
        refused = chelm.run("upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE, "--reuse-values",
                            "--set", "namespaceRouter.replica=3", check=False)
        assert refused.returncode != 0
        assert "additional properties 'replica' not allowed" in refused.stderr

        env.kubectl("delete", "inferenceservice", "chat", "-n", WORKLOADS, "--wait=false")
        wait_until(lambda: env.kubectl("get", "inferenceservice", "chat", "-n", WORKLOADS,
                                       check=False).returncode != 0,
                   60, interval=0.5, what="chat deleted (the operator drops its finalizer)")
    finally:
        exit_code = operator.stop()
        env.kubectl("delete", "namespace", WORKLOADS, "--wait=false", check=False)
    assert exit_code == 0, operator.log()[-3000:]

    # Uninstall: nothing of the release is left but the CRD (and so every user's resources).
    chelm.run("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "180s")
    wait_until(lambda: _release_leftovers(env) == [], 60, interval=1.0,
               what=f"no object of the release left: {_release_leftovers(env)}")
    assert env.kubectl("get", "crd", CRD, check=False).returncode == 0
    assert env.kubectl("get", "secrets", "-n", NAMESPACE, "-o", "name").stdout.strip() == ""
    env.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
