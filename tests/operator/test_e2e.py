"""The operator end to end on a real kube-apiserver (etcd, controller-manager, scheduler, kwok).

`kvscale operator` runs as a subprocess under the ServiceAccount identity and RBAC of
deploy/rbac.yaml, with short intervals. kwok pods run no containers, so the autoscaler reads
real HTTP metric endpoints served by this test, found through the documented
serving.kvscale.io/metrics-url pod annotation (--allow-metrics-url-override).
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_helpers import MetricsEndpoint, OperatorProcess, PodMetrics, wait_for
from testenv import kwok_toleration

from kvscale.operator.children.servers import TERMINATION_GRACE_PERIOD_SECONDS
from kvscale.operator.kube import Kube, load_connection

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
OPERATOR_SA = "system:serviceaccount:kvscale-system:kvscale-operator"
OPERATOR_GROUPS = ["system:serviceaccounts", "system:serviceaccounts:kvscale-system"]
# The operator under test serves these namespaces only, so that the RBAC test can run a second,
# deliberately crippled operator on its own namespace without the two meeting.
WATCHED = ["kvis-basic", "kvis-rollout", "kvis-problems", "kvis-restart", "kvis-autoscale"]
UNWATCHED = "kvis-rbac"
LABEL = "serving.kvscale.io/inferenceservice"
FAST_FLAGS = ["--resync-interval", "1", "--scrape-interval", "1", "--scrape-timeout", "0.5",
              "--allow-metrics-url-override", "--leader-election-namespace", "kvscale-system",
              "--lease-duration", "4", "--renew-deadline", "3", "--retry-period", "0.5"]


class Cluster:
    """The test's view of the control plane and of the operator currently leading."""

    def __init__(self, env: Any, tmp: Path):
        self.env = env
        self.tmp = tmp
        self.admin = Kube(load_connection(str(env.kubeconfig)))
        self.operator_kubeconfig = env.kubeconfig_for_user(OPERATOR_SA, OPERATOR_GROUPS)
        self.operator: OperatorProcess | None = None
        self._started = 0

    def kubectl(self, *args: str, check: bool = True, input: str | None = None):
        return self.env.kubectl(*args, check=check, input=input)

    def get(self, kind: str, name: str, namespace: str) -> dict | None:
        proc = self.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def items(self, kind: str, namespace: str, selector: str | None = None) -> list[dict]:
        args = ["get", kind, "-n", namespace, "-o", "json"]
        if selector:
            args += ["-l", selector]
        return json.loads(self.kubectl(*args).stdout)["items"]

    def start_operator(self, *extra: str, identity: str | None = None,
                       kubeconfig: Path | None = None) -> OperatorProcess:
        self._started += 1
        name = identity or f"operator-{self._started}"
        namespaces = [arg for ns in WATCHED for arg in ("--namespace", ns)]
        return OperatorProcess(kubeconfig or self.operator_kubeconfig,
                               self.tmp / f"{name}.log", *FAST_FLAGS, "--identity", name,
                               *(extra or namespaces))

    def explain(self) -> str:
        return f"\n--- operator log (tail) ---\n{self.operator.log()[-6000:]}" if self.operator else ""


def inference_service(name: str, namespace: str, **spec: Any) -> dict:
    body = {
        "model": {"uri": "bundled://smollm2-135m-instruct"},
        "image": "ghcr.io/kvscale/kvscale:0.1.0",
        "resources": {"gpus": 1, "cpu": "1", "memory": "2Gi"},
        "tolerations": [kwok_toleration()],
        **spec,
    }
    return {"apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace}, "spec": body}


def apply(cluster: Cluster, obj: dict) -> None:
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))


def condition(obj: dict | None, type_: str) -> dict:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return {}


def events_for(cluster: Cluster, namespace: str, name: str) -> list[dict]:
    return [e for e in cluster.items("events", namespace)
            if e["involvedObject"].get("name") == name
            and e["involvedObject"].get("kind") == "InferenceService"]


def delete_and_wait_gone(cluster: Cluster, namespace: str, name: str) -> None:
    cluster.kubectl("delete", "kvis", name, "-n", namespace, "--wait=false")

    def leftovers() -> list[str]:
        # What still stands, with what holds it, so a timeout says why.
        left = [f"pod/{p['metadata']['name']} deleting={bool(p['metadata'].get('deletionTimestamp'))}"
                f" finalizers={p['metadata'].get('finalizers')}"
                for p in cluster.items("pods", namespace, f"{LABEL}={name}")]
        kvis = cluster.get("kvis", name, namespace)
        if kvis is not None:
            left.append(f"kvis/{name} finalizers={kvis['metadata'].get('finalizers')}")
        return left

    # kwok, like a kubelet whose container ignores SIGTERM, removes a deleted pod at a random
    # moment up to its grace period: wait for the grace period plus the cascade around it.
    try:
        wait_for(f"{namespace}/{name} and its pods to go", lambda: not leftovers(),
                 timeout=TERMINATION_GRACE_PERIOD_SECONDS + 30)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still there: {leftovers()}") from exc


@pytest.fixture(scope="module")
def cluster(k8s_env, tmp_path_factory) -> Any:
    tmp = tmp_path_factory.mktemp("operator")
    c = Cluster(k8s_env, tmp)
    c.kubectl("apply", "-f", str(REPO_ROOT / "crds"))
    c.env.wait_established("inferenceservices.serving.kvscale.io")
    c.kubectl("apply", "-f", str(REPO_ROOT / "deploy" / "rbac.yaml"))
    for namespace in [*WATCHED, UNWATCHED]:
        c.kubectl("create", "namespace", namespace)
    c.operator = c.start_operator(identity="operator-a")
    try:
        yield c
    finally:
        if c.operator is not None:
            c.operator.stop()
        c.admin.close()


# --------------------------------------------------------------------------- the CRD


def test_crds_apply_and_serve_kvis(cluster):
    out = cluster.kubectl("apply", "-f", str(REPO_ROOT / "crds")).stdout
    assert "inferenceservices.serving.kvscale.io" in out
    crd = cluster.get("crd", "inferenceservices.serving.kvscale.io", "default")
    assert crd["spec"]["names"]["shortNames"] == ["kvis"]
    assert crd["spec"]["scope"] == "Namespaced"
    assert "kvis" in cluster.kubectl("api-resources", "--api-group=serving.kvscale.io").stdout


INVALID = {
    "min above max": (
        {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
        "autoscaling.minReplicas must be less than or equal to autoscaling.maxReplicas"),
    "target above 1": (
        {"autoscaling": {"targetKVUsage": 1.5}},
        "autoscaling.targetKVUsage must be greater than 0 and at most 1"),
    "target zero": (
        {"autoscaling": {"targetKVUsage": 0}},
        "autoscaling.targetKVUsage must be greater than 0 and at most 1"),
    "unknown model source": (
        {"model": {"uri": "s3://bucket/llama"}},
        "model.uri must name exactly one model source"),
    "two sources in one": (
        {"model": {"uri": "hf://org/name/pvc://claim/x"}},
        "model.uri must name exactly one model source"),
    "managed flag in extraArgs": (
        {"engine": {"extraArgs": ["--port=9000"]}},
        "engine.extraArgs must not repeat a flag the spec sets"),
    "batched tokens below seqs": (
        {"engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 16}},
        "engine.maxNumBatchedTokens must be at least engine.maxNumSeqs"),
    "gpu memory above 1": (
        {"engine": {"gpuMemoryUtilization": 1.2}},
        "engine.gpuMemoryUtilization must be greater than 0 and at most 1"),
    "block size not in enum": (
        {"engine": {"blockSize": 7}}, "Unsupported value: 7"),
    "negative replicas": ({"replicas": -1}, "should be greater than or equal to 0"),
    "scale to zero without the router": (
        {"autoscaling": {"enabled": True, "minReplicas": 0}, "router": {"enabled": False}},
        "autoscaling.minReplicas 0 needs the router"),
    "the bundled model on ranks its heads do not split into": (
        {"resources": {"gpus": 2}},
        "the bundled model runs on 0, 1 or 3 GPUs (resources.gpus): more than one is that many "
        "tensor-parallel ranks, which must divide its 9 attention heads"),
    "several nodes without GPUs": (
        {"model": {"uri": "hf://org/llama"}, "resources": {"gpus": 0}, "engine": {"nodes": 2}},
        "engine.nodes above 1 needs resources.gpus of at least 1"),
    "more nodes than the bound": ({"engine": {"nodes": 17}}, "should be less than or equal to 16"),
    "the bundled model on ranks of several nodes its heads do not split into": (
        {"engine": {"nodes": 2}},
        "the bundled model runs on 1 or 3 tensor-parallel ranks in all (resources.gpus x engine.nodes)"),
    "a password in the Redis URL": (
        {"router": {"redis": {"url": "redis://:hunter2@redis.example:6379/0"}}},
        "router.redis.url must not hold credentials"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_resources_are_rejected_with_readable_messages(cluster, case):
    spec, message = INVALID[case]
    obj = inference_service("bad", "kvis-basic", **spec)
    proc = cluster.kubectl("create", "--dry-run=server", "-f", "-", check=False,
                           input=yaml.safe_dump(obj))
    assert proc.returncode != 0, f"{case}: accepted"
    assert message in proc.stderr, proc.stderr


BAD_NAMES = {
    "a dot": ("chat.v1", "metadata.name must be at most 56 characters"),
    "too long for NAME-router": ("a" * 57, "metadata.name must be at most 56 characters"),
    "a leading digit": ("9chat", "metadata.name must be at most 56 characters"),
    "another's router": ("chat-router", "metadata.name must not end in -router, -redis, -pods or -ranks"),
    "another's redis": ("chat-redis", "metadata.name must not end in -router, -redis, -pods or -ranks"),
    "another's pods": ("chat-pods", "metadata.name must not end in -router, -redis, -pods or -ranks"),
    "another's ranks": ("chat-ranks", "metadata.name must not end in -router, -redis, -pods or -ranks"),
}


@pytest.mark.parametrize("case", list(BAD_NAMES))
def test_names_its_children_cannot_carry_are_rejected(cluster, case):
    name, message = BAD_NAMES[case]
    proc = cluster.kubectl("create", "--dry-run=server", "-f", "-", check=False,
                           input=yaml.safe_dump(inference_service(name, "kvis-basic")))
    assert proc.returncode != 0, f"{case}: accepted"
    assert message in proc.stderr, proc.stderr
    longest = "a" * 56  # NAME-router is 63: still a DNS label
    cluster.kubectl("create", "--dry-run=server", "-f", "-",
                    input=yaml.safe_dump(inference_service(longest, "kvis-basic")))


def test_valid_resource_passes_validation_with_defaults(cluster):
    adapters = [{"name": "sql", "uri": "hf://org/sql-lora"}]  # the schema takes LoRA adapters
    proc = cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                           input=yaml.safe_dump(inference_service("ok", "kvis-basic", adapters=adapters)))
    spec = json.loads(proc.stdout)["spec"]
    assert spec["adapters"] == adapters
    assert spec["replicas"] == 1
    assert spec["engine"]["blockSize"] == 16 and spec["engine"]["enablePrefixCaching"] is True
    assert spec["autoscaling"] == {
        "enabled": False, "minReplicas": 1, "maxReplicas": 4, "targetKVUsage": 0.7,
        "targetQueueLength": 8, "targetPrefillSeconds": 1, "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 300, "panicWindowSeconds": 6, "panicThreshold": 2,
        "maxScaleUpRate": 2, "scaleToZeroAfterSeconds": 300, "activationTimeoutSeconds": 120}
    # Scale to zero is valid with the router (the default).
    cluster.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(inference_service(
        "zero", "kvis-basic", autoscaling={"enabled": True, "minReplicas": 0})))


# --------------------------------------------------------------------------- reconciliation


def test_new_service_gets_children_ready_status_scale_and_columns(cluster):
    ns, name = "kvis-basic", "chat"
    cluster.kubectl("create", "secret", "generic", "chat-key", "-n", ns,
                    "--from-literal=api-key=s3cret")
    apply(cluster, inference_service(
        name, ns, engine={"maxNumSeqs": 32, "blockSize": 32},
        apiKeySecretRef={"name": "chat-key"}))
    kvis = cluster.get("kvis", name, ns)

    deployment = wait_for("the Deployment", lambda: cluster.get("deployment", name, ns))
    owner = deployment["metadata"]["ownerReferences"]
    assert owner == [{"apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
                      "name": name, "uid": kvis["metadata"]["uid"], "controller": True,
                      "blockOwnerDeletion": True}]
    assert deployment["metadata"]["labels"][LABEL] == name
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--max-num-seqs") + 1] == "32"
    assert args[args.index("--block-size") + 1] == "32"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    key_env = next(e for e in container["env"] if e["name"] == "KVSCALE_API_KEY")
    assert key_env["valueFrom"]["secretKeyRef"]["name"] == "chat-key"

    # Each child is its own create: the Services may land after the Deployment.
    service = wait_for("the Service", lambda: cluster.get("service", name, ns))
    headless = wait_for("the headless Service", lambda: cluster.get("service", f"{name}-pods", ns))
    # The service's URL leads to its router; the router finds the servers through the headless one.
    assert service["spec"]["selector"] == {"serving.kvscale.io/router": name}
    assert headless["spec"]["selector"] == {LABEL: name}
    assert headless["spec"]["clusterIP"] == "None"
    for svc in (service, headless):
        assert svc["metadata"]["ownerReferences"][0]["uid"] == kvis["metadata"]["uid"]

    ready = wait_for("Ready=True", lambda: (o := cluster.get("kvis", name, ns))
                     and condition(o, "Ready").get("status") == "True" and o, timeout=60)
    status = ready["status"]
    assert status["readyReplicas"] == 1 and status["replicas"] == 1
    assert status["observedGeneration"] == ready["metadata"]["generation"]
    assert status["selector"] == f"{LABEL}={name}"
    assert status["url"] == f"http://{name}.{ns}.svc.cluster.local"
    assert condition(ready, "Ready")["reason"] == "Serving"
    assert condition(ready, "ScalingActive")["reason"] == "AutoscalingDisabled"

    # kvUsage and the pod-deletion-cost come from the pods' metrics even without autoscaling.
    endpoint = MetricsEndpoint(PodMetrics(kv_blocks_active=420, kv_blocks_total=1000))
    try:
        pod = cluster.items("pods", ns, f"{LABEL}={name}")[0]
        cluster.kubectl("annotate", "pod", pod["metadata"]["name"], "-n", ns,
                        f"serving.kvscale.io/metrics-url={endpoint.url}")
        wait_for("kvUsage", lambda: (cluster.get("kvis", name, ns)["status"].get("kvUsage")
                                     == pytest.approx(0.42)), timeout=30)
        annotated = cluster.get("pod", pod["metadata"]["name"], ns)
        # Live blocks count twice (operator/deletion_cost.py): a request to drain, a warm prefix.
        assert annotated["metadata"]["annotations"][
            "controller.kubernetes.io/pod-deletion-cost"] == "840"

        table = cluster.kubectl("get", "kvis", "-n", ns).stdout.splitlines()
        assert table[0].split() == ["NAME", "MODEL", "REPLICAS", "READY", "KV-USAGE", "URL", "STATUS",
                                    "AGE"]
        assert table[1].split()[:7] == [name, "bundled://smollm2-135m-instruct", "1", "1",
                                        "0.42", status["url"], "Serving"]

        # kubectl scale reaches the Deployment through the scale subresource; the operator
        # leaves replicas alone since autoscaling is off (the high usage notwithstanding).
        endpoint.metrics.kv_blocks_active = 990
        cluster.kubectl("scale", f"kvis/{name}", "-n", ns, "--replicas=3")
        wait_for("3 ready replicas", lambda: cluster.get("kvis", name, ns)["status"].get(
            "readyReplicas") == 3, timeout=60)
        assert cluster.get("deployment", name, ns)["spec"]["replicas"] == 3
        scale = json.loads(cluster.kubectl("get", "--raw",
                                           f"/apis/serving.kvscale.io/v1alpha1/namespaces/{ns}"
                                           f"/inferenceservices/{name}/scale").stdout)
        assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
        assert scale["status"]["selector"] == f"{LABEL}={name}"
    finally:
        endpoint.close()
    assert cluster.get("kvis", name, ns)["spec"]["replicas"] == 3

    # Deleting the InferenceService garbage-collects everything it owns.
    delete_and_wait_gone(cluster, ns, name)
    wait_for("children collected", lambda: cluster.get("deployment", name, ns) is None
             and cluster.get("service", name, ns) is None
             and cluster.get("service", f"{name}-pods", ns) is None, timeout=60)


def test_spec_update_rolls_out(cluster):
    ns, name = "kvis-rollout", "roll"
    apply(cluster, inference_service(name, ns))
    wait_for("Ready", lambda: condition(cluster.get("kvis", name, ns), "Ready").get("status")
             == "True", timeout=60)
    before = cluster.get("deployment", name, ns)
    cluster.kubectl("patch", "kvis", name, "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"engine": {"maxNumSeqs": 8, "dtype": "float16"}}}))

    def rolled() -> bool:
        deployment = cluster.get("deployment", name, ns)
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        return (args[args.index("--max-num-seqs") + 1] == "8"
                and args[args.index("--dtype") + 1] == "float16"
                and deployment["status"].get("updatedReplicas") == 1
                and deployment["status"].get("readyReplicas") == 1
                and deployment["status"].get("observedGeneration")
                == deployment["metadata"]["generation"])

    wait_for("the new template rolled out", rolled, timeout=60)
    after = cluster.get("deployment", name, ns)
    assert after["metadata"]["uid"] == before["metadata"]["uid"]  # updated, not recreated
    assert after["metadata"]["generation"] > before["metadata"]["generation"]
    replica_sets = cluster.items("replicasets", ns, f"{LABEL}={name}")
    assert len(replica_sets) == 2  # old and new template
    kvis = wait_for("status for the new generation", lambda: (
        o := cluster.get("kvis", name, ns))["status"].get("observedGeneration")
        == o["metadata"]["generation"] and o)
    assert condition(kvis, "Ready")["status"] == "True"
    delete_and_wait_gone(cluster, ns, name)


def user_service(name: str, namespace: str) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80, "targetPort": 8080}]}}


def test_a_name_someone_else_holds_is_never_taken_over(cluster):
    """A user's Service first, then the InferenceService whose headless
    Service would carry its name: the operator leaves it untouched, says so (Synced=False,
    NameConflict, a Warning Event) and does not claim the generation observed; once the name is
    free it applies and observes it. The other order: the InferenceService first, and the
    apiserver refuses the user's same-named object."""
    ns, name = "kvis-problems", "taken"
    apply(cluster, user_service(f"{name}-pods", ns))
    apply(cluster, inference_service(name, ns, router={"enabled": False}))
    synced = wait_for("Synced=False", lambda: (c := condition(cluster.get("kvis", name, ns), "Synced"))
                      and c["status"] == "False" and c, timeout=60)
    assert synced["reason"] == "NameConflict" and f"Service {name}-pods already exists" in synced["message"]
    status = cluster.get("kvis", name, ns)["status"]
    assert status.get("observedGeneration") is None, status
    theirs = cluster.get("service", f"{name}-pods", ns)
    assert theirs["spec"]["selector"] == {"app": "theirs"}
    assert not theirs["metadata"].get("ownerReferences")
    assert any(e["reason"] == "NameConflict" and e["type"] == "Warning"
               for e in events_for(cluster, ns, name)), cluster.explain()

    cluster.kubectl("delete", "service", f"{name}-pods", "-n", ns)
    applied = wait_for("Synced=True", lambda: (o := cluster.get("kvis", name, ns))
                       and condition(o, "Synced").get("status") == "True" and o, timeout=60)
    assert applied["status"]["observedGeneration"] == applied["metadata"]["generation"]
    ours = cluster.get("service", f"{name}-pods", ns)
    assert ours["metadata"]["ownerReferences"][0]["name"] == name

    refused = cluster.kubectl("create", "-f", "-", check=False,
                              input=yaml.safe_dump(user_service(f"{name}-pods", ns)))
    assert refused.returncode != 0 and "AlreadyExists" in refused.stderr
    delete_and_wait_gone(cluster, ns, name)


def test_problems_show_as_conditions_and_events(cluster):
    # A missing API-key Secret is learnt from the pods' CreateContainerConfigError, which kwok's
    # pods never report: tests/operator/test_platform_secrets.py checks it with real pods.
    ns = "kvis-problems"
    # More GPUs than any node has. Not the bundled model: its 9 heads split over 1 or 3 ranks
    # only, which the API server refuses before any pod exists (docs/operator.md, "Several GPUs per
    # replica"). A hub model's heads the operator cannot know, and kwok never runs its pods; ranks
    # on GPUs need their KV pool's size given.
    apply(cluster, inference_service("huge", ns, model={"uri": "hf://kvscale-tests/huge"}, resources={"gpus": 16},
                                     engine={"extraArgs": ["--num-gpu-blocks-override", "64"]}))
    try:
        huge = wait_for("Unschedulable", lambda: (o := cluster.get("kvis", "huge", ns))
                        and condition(o, "Ready").get("reason") == "Unschedulable" and o)
        assert "nvidia.com/gpu" in condition(huge, "Ready")["message"]
        assert huge["status"]["readyReplicas"] == 0

        def warning(name: str, reason: str) -> bool:
            return any(e["type"] == "Warning" and e["reason"] == reason
                       for e in events_for(cluster, ns, name))

        wait_for("Unschedulable event", lambda: warning("huge", "Unschedulable"), timeout=30)
    finally:
        delete_and_wait_gone(cluster, ns, "huge")


def test_restart_resumes_and_a_standby_does_not_fight(cluster):
    ns, name = "kvis-restart", "resume"
    apply(cluster, inference_service(name, ns))
    wait_for("Ready", lambda: condition(cluster.get("kvis", name, ns), "Ready").get("status")
             == "True", timeout=60)
    original = cluster.get("deployment", name, ns)

    standby = cluster.start_operator(identity="operator-b")
    try:
        wait_for("the standby to wait for the lease",
                 lambda: "waiting to lead" in standby.log(), timeout=30)
        lease = cluster.get("lease", "kvscale-operator", "kvscale-system")
        assert lease["spec"]["holderIdentity"] == "operator-a"
        assert standby.alive()

        # Stop the leader; change the resource while no operator acts on it.
        assert cluster.operator is not None
        cluster.operator.stop(signal.SIGTERM)
        cluster.kubectl("scale", f"kvis/{name}", "-n", ns, "--replicas=2")
        # The standby takes over (the lease was released) and resumes the work.
        wait_for("the standby to lead", lambda: "became the leader" in standby.log(), timeout=30)
        cluster.operator = standby
        wait_for("2 ready replicas after the takeover", lambda: cluster.get(
            "kvis", name, ns)["status"].get("readyReplicas") == 2, timeout=60)
    except BaseException:
        cluster.operator = standby
        raise
    assert cluster.get("lease", "kvscale-operator", "kvscale-system")["spec"][
        "holderIdentity"] == "operator-b"
    deployments = cluster.items("deployments", ns, f"{LABEL}={name}")
    services = cluster.items("services", ns, f"{LABEL}={name}")
    assert len(deployments) == 1 and len(services) == 2  # nothing duplicated
    assert deployments[0]["metadata"]["uid"] == original["metadata"]["uid"]
    assert len(deployments[0]["metadata"]["ownerReferences"]) == 1
    delete_and_wait_gone(cluster, ns, name)


# --------------------------------------------------------------------------- RBAC


def test_rbac_is_least_privilege(cluster):
    def can(verb: str, resource: str, namespace: str = "kvis-basic") -> bool:
        scope = ["-n", namespace] if namespace else []
        proc = cluster.kubectl("auth", "can-i", verb, resource, *scope, f"--as={OPERATOR_SA}",
                               *[f"--as-group={g}" for g in OPERATOR_GROUPS], check=False)
        return proc.stdout.strip() == "yes"

    assert can("patch", "inferenceservices.serving.kvscale.io/scale")
    assert can("create", "deployments.apps") and can("patch", "pods")
    # delete: only to remove a router or Redis the spec turned off (the GC removes the rest).
    assert can("delete", "deployments.apps") and not can("deletecollection", "deployments.apps")
    assert can("create", "roles.rbac.authorization.k8s.io") and not can("escalate", "roles.rbac.authorization.k8s.io")
    assert not can("list", "secrets") and not can("watch", "secrets")
    assert not can("delete", "pods") and not can("create", "pods")
    assert not can("update", "nodes", "")
    assert not can("update", "leases.coordination.k8s.io", "kvis-basic")
    assert can("update", "leases.coordination.k8s.io/kvscale-operator", "kvscale-system")


def test_a_missing_verb_fails(cluster):
    """The same operator under a ClusterRole lacking `create services` cannot do its job."""
    rbac = list(yaml.safe_load_all((REPO_ROOT / "deploy" / "rbac.yaml").read_text()))
    role = next(d for d in rbac if d["kind"] == "ClusterRole")
    role["metadata"]["name"] = "kvscale-operator-crippled"
    for rule in role["rules"]:
        if "services" in rule["resources"]:
            rule["verbs"] = [v for v in rule["verbs"] if v != "create"]
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": "kvscale-operator-crippled"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                           "name": "kvscale-operator-crippled"},
               "subjects": [{"kind": "User", "name": "crippled-operator"}]}
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([role, binding]))
    kubeconfig = cluster.env.kubeconfig_for_user("crippled-operator", [])
    crippled = cluster.start_operator("--namespace", UNWATCHED, "--no-leader-elect",
                                      identity="crippled", kubeconfig=kubeconfig)
    try:
        apply(cluster, inference_service("denied", UNWATCHED))
        wait_for("a 403 in the operator's log", lambda: "forbidden" in crippled.log().lower(),
                 timeout=30)
        assert cluster.get("deployment", "denied", UNWATCHED) is not None  # what it may do, done
        assert cluster.get("service", "denied", UNWATCHED) is None
        assert 'cannot create resource "services"' in crippled.log()
    finally:
        crippled.stop()
        # No finalizer: deletion completes with no operator running.
        cluster.kubectl("delete", "kvis", "denied", "-n", UNWATCHED, "--timeout=30s")


# --------------------------------------------------------------------------- autoscaler


class PodMetricsFeeder:
    """Gives every pod of an InferenceService its own real metrics endpoint, via the annotation."""

    def __init__(self, cluster: Cluster, namespace: str, name: str):
        self.cluster, self.namespace, self.name = cluster, namespace, name
        self.endpoints: dict[str, MetricsEndpoint] = {}
        self.default = PodMetrics()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def set_all(self, **values: float) -> None:
        for key, value in values.items():
            setattr(self.default, key, value)
            for endpoint in self.endpoints.values():
                setattr(endpoint.metrics, key, value)

    def _run(self) -> None:
        from kvscale.operator.kube import path_for

        while not self._stop.wait(0.3):
            try:
                pods = self.cluster.admin.list(path_for("v1", "pods", self.namespace),
                                               f"{LABEL}={self.name}")
            except Exception:
                continue
            for pod in pods:
                pod_name = pod["metadata"]["name"]
                if pod_name in self.endpoints:
                    continue
                endpoint = MetricsEndpoint(PodMetrics(**vars(self.default)))
                self.endpoints[pod_name] = endpoint
                self.cluster.admin.merge_patch(
                    path_for("v1", "pods", self.namespace, pod_name),
                    {"metadata": {"annotations": {
                        "serving.kvscale.io/metrics-url": endpoint.url}}})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for endpoint in self.endpoints.values():
            endpoint.close()


def scaled_event(cluster: Cluster, namespace: str, name: str, words: str) -> bool:
    return any(e["reason"] == "Scaled" and words in e["message"] for e in events_for(cluster, namespace, name))


def test_autoscaler_scales_up_under_load_and_down_after_the_window(cluster):
    ns, name = "kvis-autoscale", "auto"
    feeder = PodMetricsFeeder(cluster, ns, name)
    feeder.set_all(kv_blocks_active=900, kv_blocks_total=1000)
    apply(cluster, inference_service(name, ns, autoscaling={
        "enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetKVUsage": 0.5,
        "scaleDownStabilizationSeconds": 8, "panicWindowSeconds": 2}))
    try:
        wait_for("scale-up to 3", lambda: cluster.get("kvis", name, ns)["spec"]["replicas"] == 3,
                 timeout=60)
        wait_for("3 ready replicas", lambda: cluster.get("kvis", name, ns)["status"].get(
            "readyReplicas") == 3, timeout=60)
        kvis = cluster.get("kvis", name, ns)
        assert cluster.get("deployment", name, ns)["spec"]["replicas"] == 3
        assert kvis["status"]["desiredReplicas"] == 3
        assert kvis["status"]["kvUsage"] == pytest.approx(0.9)
        assert "lastScaleTime" in kvis["status"]
        assert condition(kvis, "ScalingActive")["status"] == "True"
        # kopf posts Events from a queue of its own: they may come a moment after the change.
        wait_for("a Scaled event saying scaled up", lambda: scaled_event(cluster, ns, name, "scaled up"), timeout=30)

        # Give the pods distinct caches, then drop the load: after the stabilization window the
        # autoscaler goes back to 1, and the survivor is the pod with the warmest cache: the
        # first holds no live request but a large idle prefix cache (which a cost from active
        # blocks alone would have removed first).
        pods = sorted(p["metadata"]["name"] for p in cluster.items("pods", ns, f"{LABEL}={name}"))
        wait_for("every pod fed", lambda: all(p in feeder.endpoints for p in pods))
        for (active, cached), pod in zip(((0, 300), (40, 0), (10, 0)), pods, strict=True):
            feeder.endpoints[pod].metrics.kv_blocks_active = active
            feeder.endpoints[pod].metrics.kv_blocks_cached = cached
        wait_for("deletion costs", lambda: [
            cluster.get("pod", p, ns)["metadata"]["annotations"].get(
                "controller.kubernetes.io/pod-deletion-cost") for p in pods] == ["300", "80", "20"],
            timeout=20)
        assert cluster.get("kvis", name, ns)["spec"]["replicas"] == 3  # the window holds it
        wait_for("scale-down to 1", lambda: cluster.get("kvis", name, ns)["spec"]["replicas"] == 1,
                 timeout=60)
        survivors = wait_for("one pod left", lambda: (
            left := [p["metadata"]["name"] for p in cluster.items("pods", ns, f"{LABEL}={name}")
                     if not p["metadata"].get("deletionTimestamp")]) and len(left) == 1 and left,
            timeout=60)
        assert survivors == [pods[0]], "scale-in should keep the pod with the warmest cache"
        wait_for("a Scaled event saying scaled down", lambda: scaled_event(cluster, ns, name, "scaled down"),
                 timeout=30)
    except AssertionError as exc:
        raise AssertionError(f"{exc}{cluster.explain()}") from exc
    finally:
        feeder.close()
        delete_and_wait_gone(cluster, ns, name)
