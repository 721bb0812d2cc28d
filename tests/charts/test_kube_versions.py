"""The chart's `kubeVersion` floor is true: every object the chart renders, every child the operator
builds for an InferenceService, and the CRD are accepted by a kube-apiserver of the oldest
supported minor, with no field silently dropped.

The apiserver is built from Go modules as the test control plane is (tools/k8s-oldest.sh, the
tools/k8s-oldest module) and runs with that control plane's etcd. An apiserver whose feature gate
for a field is off accepts the object and drops the field (as 1.29 does with
`lifecycle.preStop.sleep`), so each object sent is compared with the one the apiserver returns
from `kubectl apply --dry-run=server`.
"""

from __future__ import annotations

import base64
import json
import re
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import ALL_ON, CHART, REPO_ROOT, Helm
from testenv import issue_cert, kubeconfig_yaml, make_ca, make_signing_key_pair

from kvscale.operator.children.owned import build_children
from kvscale.operator.children.redis import build_redis_secret
from kvscale.operator.spec import parse_spec
from kvscale.processes import die_with_parent, free_port, wait_until

pytestmark = pytest.mark.slow

OLDEST_SCRIPT = REPO_ROOT / "tools" / "k8s-oldest.sh"
NAMESPACE = "kvscale-system"
SERVICES_NAMESPACE = "default"


def chart_floor() -> tuple[int, int]:
    """(major, minor) of Chart.yaml's `kubeVersion: >=X.Y...`."""
    constraint = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)(\.\d+)?(-0)?", constraint.strip())
    assert match, f"kubeVersion {constraint!r} is not a plain lower bound"
    return int(match[1]), int(match[2])


@dataclass
class Apiserver:
    server: str
    kubeconfig: Path
    kubectl_bin: Path
    version: dict[str, str]

    def kubectl(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.kubectl_bin), f"--kubeconfig={self.kubeconfig}", *args],
                              input=input, capture_output=True, text=True, timeout=300, check=False)


def _spawn(binary: Path, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([str(binary), *args], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, preexec_fn=die_with_parent)


def _get(url: str, context: ssl.SSLContext | None = None) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as response:
            return response.read() if response.status == 200 else None
    except OSError:
        return None


@pytest.fixture(scope="module")
def oldest_apiserver(k8s_bins: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Apiserver]:
    """etcd (the test control plane's) and kube-apiserver at the chart's floor, on loopback."""
    built = subprocess.run(["bash", str(OLDEST_SCRIPT)], stdout=subprocess.PIPE, text=True,
                           timeout=3600, check=False)
    assert built.returncode == 0 and built.stdout.strip(), f"{OLDEST_SCRIPT} failed"
    apiserver_bin = Path(built.stdout.strip().splitlines()[-1]) / "kube-apiserver"
    work = tmp_path_factory.mktemp("oldest-apiserver")
    pki = work / "pki"
    pki.mkdir()
    ca = make_ca()
    serving = issue_cert(ca, "kube-apiserver", server_names=("localhost",), server_ips=("127.0.0.1",))
    admin = issue_cert(ca, "admin", ("system:masters",))
    accounts = make_signing_key_pair()
    for name, data in (("ca.crt", ca.cert), ("apiserver.crt", serving.cert),
                       ("apiserver.key", serving.key), ("sa.pub", accounts.cert),
                       ("sa.key", accounts.key)):
        (pki / name).write_bytes(data)
    etcd_port, peer_port, port = free_port(), free_port(), free_port()
    etcd_url, peer_url = f"http://127.0.0.1:{etcd_port}", f"http://127.0.0.1:{peer_port}"
    server = f"https://127.0.0.1:{port}"
    kubeconfig = work / "kubeconfig"
    kubeconfig.write_text(kubeconfig_yaml(server, ca.cert, "admin", {
        "client-certificate-data": base64.b64encode(admin.cert).decode(),
        "client-key-data": base64.b64encode(admin.key).decode()}))
    processes = []
    try:
        processes.append(_spawn(k8s_bins / "etcd", [
            "--name=default", f"--data-dir={work / 'etcd-data'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}", "--unsafe-no-fsync", "--log-level=warn",
        ], work / "etcd.log"))
        wait_until(lambda: b'"health":"true"' in (_get(f"{etcd_url}/health") or b""), 60,
                   what="etcd /health")
        # The test control plane's flags (tests/cluster/testenv.py), nothing more.
        service_cidr = f"127.245.{port % 256}.0/24"
        processes.append(_spawn(apiserver_bin, [
            f"--etcd-servers={etcd_url}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={port}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}", f"--client-ca-file={pki / 'ca.crt'}",
            "--authorization-mode=RBAC", f"--service-cluster-ip-range={service_cidr}",
            "--allow-privileged=true", f"--service-account-issuer={server}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--endpoint-reconciler-type=none", "--profiling=false",
        ], work / "kube-apiserver.log"))
        admin_tls = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        (work / "admin.crt").write_bytes(admin.cert)
        (work / "admin.key").write_bytes(admin.key)
        admin_tls.load_cert_chain(str(work / "admin.crt"), str(work / "admin.key"))

        def ready() -> bool:
            assert processes[-1].poll() is None, (work / "kube-apiserver.log").read_text()[-4000:]
            return _get(f"{server}/readyz", admin_tls) == b"ok"

        wait_until(ready, 120, what="kube-apiserver /readyz")
        version = json.loads(_get(f"{server}/version", admin_tls) or b"{}")
        yield Apiserver(server, kubeconfig, k8s_bins / "kubectl", version)
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# --------------------------------------------------------------------------- what is compared

# Spellings the apiserver normalises without losing anything.
_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)([a-zA-Z]*)$")


def missing_fields(sent: Any, returned: Any, path: str = "") -> list[str]:
    """Paths of what was sent and is not in what the apiserver returned (a dropped field, a
    shortened list, a changed value)."""
    if isinstance(sent, dict):
        if not isinstance(returned, dict):
            return [f"{path}: sent an object, got {returned!r}"]
        found = []
        for key, value in sent.items():
            if key not in returned:
                found.append(f"{path}.{key}")
            else:
                found += missing_fields(value, returned[key], f"{path}.{key}")
        return found
    if isinstance(sent, list):
        if not isinstance(returned, list) or len(returned) != len(sent):
            return [f"{path}: sent {len(sent)} items, got {returned!r}"]
        return [gap for i, (a, b) in enumerate(zip(sent, returned, strict=True))
                for gap in missing_fields(a, b, f"{path}[{i}]")]
    if sent == returned or str(sent) == str(returned):
        return []
    return [f"{path}: sent {sent!r}, got {returned!r}"]


def dry_run(apiserver: Apiserver, objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each object as `kubectl apply --dry-run=server` returns it (in the order sent)."""
    listed = {"apiVersion": "v1", "kind": "List", "items": objects}
    result = apiserver.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-",
                               input=json.dumps(listed))
    assert result.returncode == 0, (
        f"kube-apiserver {apiserver.version.get('gitVersion')} refused:\n{result.stderr}")
    returned = json.loads(result.stdout)
    items = returned["items"] if returned.get("kind") == "List" else [returned]
    assert len(items) == len(objects)
    return items


def as_stored(sent: dict[str, Any]) -> dict[str, Any]:
    """A Secret's stringData is write-only: the apiserver stores it base64-encoded in data."""
    if sent["kind"] != "Secret" or "stringData" not in sent:
        return sent
    stored = {k: v for k, v in sent.items() if k != "stringData"}
    stored["data"] = {**sent.get("data", {}), **{
        key: base64.b64encode(value.encode()).decode() for key, value in sent["stringData"].items()}}
    return stored


def applies_intact(apiserver: Apiserver, objects: list[dict[str, Any]]) -> None:
    gaps = {}
    for sent, returned in zip(objects, dry_run(apiserver, objects), strict=True):
        key = f"{sent['kind']} {sent['metadata'].get('namespace', '')}/{sent['metadata']['name']}"
        assert (returned["kind"], returned["metadata"]["name"]) == (sent["kind"], sent["metadata"]["name"])
        if missing := missing_fields(as_stored(sent), returned):
            gaps[key] = missing
    assert not gaps, (f"kube-apiserver {apiserver.version.get('gitVersion')} dropped or changed:\n"
                      + json.dumps(gaps, indent=2))


def prepare(apiserver: Apiserver, objects: list[dict[str, Any]]) -> None:
    """What the dry-run objects need to exist for real: their namespaces, the CRD and the
    ServiceAccounts the (test) pods name."""
    needed: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}]
    # Each namespace's `default` ServiceAccount, which the controller-manager (not run here) makes.
    needed += [{"apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": "default", "namespace": namespace}}
               for namespace in (NAMESPACE, SERVICES_NAMESPACE)]
    needed += [o for o in objects if o["kind"] in ("ServiceAccount", "CustomResourceDefinition")]
    listed = {"apiVersion": "v1", "kind": "List", "items": needed}
    result = apiserver.kubectl("apply", "-f", "-", input=json.dumps(listed))
    assert result.returncode == 0, result.stderr
    deadline = time.monotonic() + 60
    while apiserver.kubectl("get", "inferenceservices", "-A").returncode != 0:
        assert time.monotonic() < deadline, "the InferenceService CRD never became served"
        time.sleep(0.5)


def crds() -> list[dict[str, Any]]:
    return [doc for path in sorted((REPO_ROOT / "crds").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def rendered(helm: Helm) -> list[dict[str, Any]]:
    """The chart with its defaults and with every optional part on (hooks and test pods too)."""
    objects = helm.template(namespace=NAMESPACE) + helm.template(*ALL_ON, namespace=NAMESPACE)
    unique = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in objects}
    return [{**o, "metadata": {"namespace": NAMESPACE, **o["metadata"]}}
            if o["kind"] not in _CLUSTER_SCOPED else o for o in unique.values()]


_CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                   "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def children() -> list[dict[str, Any]]:
    """Every kind of child the operator builds: servers, router, its RBAC and PDB, the
    operator-run Redis and its Secret, for a bundled and an hf:// model."""
    bundled = parse_spec({
        "model": {"uri": "bundled://smollm2-135m-instruct"},
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4},
        "apiKeySecretRef": {"name": "chat-key", "key": "token"},
        "router": {"tenants": [{"name": "team-a", "apiKeySecretRef": {"name": "team-a-key"},
                                "requestsPerMinute": 60}]},
    })
    hub = parse_spec({"model": {"uri": "hf://org/tiny", "servedName": "tiny"}, "replicas": 2})
    objects = [*build_children("chat", SERVICES_NAMESPACE, bundled),
               build_redis_secret("chat", SERVICES_NAMESPACE),
               *build_children("tiny", SERVICES_NAMESPACE, hub)]
    # Children carry an ownerReference to their InferenceService when applied; none here.
    return objects


# --------------------------------------------------------------------------- the tests


def test_the_apiserver_is_the_charts_oldest_supported_minor(oldest_apiserver):
    major, minor = chart_floor()
    assert (oldest_apiserver.version["major"], oldest_apiserver.version["minor"]) == (str(major), str(minor))


def test_crds_chart_and_operator_children_apply_intact_on_the_oldest_minor(oldest_apiserver, helm):
    chart = rendered(helm)
    prepare(oldest_apiserver, [*crds(), *chart])
    applies_intact(oldest_apiserver, crds())
    applies_intact(oldest_apiserver, chart)
    built = children()
    # preStop.sleep, the field 1.29 drops without an error, is among what is compared.
    assert any("sleep" in (c.get("lifecycle", {}).get("preStop") or {})
               for o in built if o["kind"] == "Deployment"
               for c in o["spec"]["template"]["spec"]["containers"])
    applies_intact(oldest_apiserver, built)


def test_tenants_are_accepted_with_defaults_and_bounded_on_the_oldest_minor(oldest_apiserver, helm):
    """spec.router.tenants through the CRD's schema and rules (docs/operator.md, "Tenants")."""
    prepare(oldest_apiserver, crds())

    def service(spec: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
                "metadata": {"name": "chat", "namespace": SERVICES_NAMESPACE},
                "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"}, **spec}}

    def refusal(spec: dict[str, Any]) -> str:
        result = oldest_apiserver.kubectl("apply", "--dry-run=server", "-f", "-",
                                          input=json.dumps(service(spec)))
        assert result.returncode != 0, spec
        return result.stderr

    key = {"apiKeySecretRef": {"name": "servers-key"}}
    tenant = {"name": "team-a", "apiKeySecretRef": {"name": "team-a-key"}}
    (returned,) = dry_run(oldest_apiserver, [service({**key, "router": {"tenants": [tenant]}})])
    assert returned["spec"]["router"]["tenants"] == [
        {**tenant, "apiKeySecretRef": {"name": "team-a-key", "key": "api-key"}, "weight": 1, "priority": 0}]
    assert "router.tenants needs apiKeySecretRef" in refusal({"router": {"tenants": [tenant]}})
    assert "router.tenants needs the router" in refusal(
        {**key, "router": {"enabled": False, "tenants": [tenant]}})
    assert "Duplicate value" in refusal({**key, "router": {"tenants": [tenant, tenant]}})
    assert "should match" in refusal({**key, "router": {"tenants": [{**tenant, "name": "Team_A"}]}})
    assert "must have at most 100 items" in refusal({**key, "router": {"tenants": [
        {**tenant, "name": f"t{i}"} for i in range(101)]}})
    assert "weight" in refusal({**key, "router": {"tenants": [{**tenant, "weight": 0}]}})


def test_a_dropped_field_is_caught():
    """The comparison fails on what an apiserver with a gate off does (drops preStop.sleep)."""
    sent = {"spec": {"containers": [{"name": "a", "lifecycle": {"preStop": {"sleep": {"seconds": 5}}}}]}}
    returned = {"spec": {"containers": [{"name": "a", "lifecycle": {}}]}}
    assert missing_fields(sent, returned) == [".spec.containers[0].lifecycle.preStop"]
    assert missing_fields(sent, sent) == []
