"""What the operator's identity may and may not do, asked of the real kube-apiserver.

The chart's ServiceAccount and RBAC (templates/serviceaccount.yaml, rbac.yaml) are rendered with
helm and applied with kubectl for each install mode: every namespace (a ClusterRole) and
`operator.watchNamespaces` (Roles in those namespaces, nothing cluster-wide). `kubectl auth can-i
--as system:serviceaccount:<ns>:<sa>` then says what is granted and what is refused (Secrets in
kube-system, pods of an unwatched namespace, cluster roles); RBAC's escalation check and the
chart's admission policy are tried for real; and in the namespaced mode the operator itself runs
under a token of that ServiceAccount and must serve its namespaces without one 403.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from chart_helpers import Helm
from module_crds import inference_pool_crd, leader_worker_set_crd
from testenv import kwok_toleration

from kvscale.operator.children.router import ENDPOINTSLICES_RULE
from kvscale.operator.deletion_cost import DELETION_COST_ANNOTATION
from kvscale.operator.kube import ApiError, Kube, load_connection, path_for
from kvscale.processes import die_with_parent, free_port, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.k8s]

REPO_ROOT = Path(__file__).resolve().parents[2]
CLUSTER_WIDE = ("rbac-cw", "rbac-cw-system")  # release, its namespace
NAMESPACED = ("rbac-ns", "rbac-ns-system")
WATCHED = ("rbac-ns-a", "rbac-ns-b")
# The namespaced release's operator.allowedApiKeySecrets (the cluster-wide one keeps ["*"]).
KEY_SECRET_PATTERNS = ("*-api-key", "team.key?")
UNWATCHED = "rbac-ns-other"
ANYWHERE = "rbac-cw-any"  # a namespace the cluster-wide operator was never told about

# Every (apiGroup, resource, verb) the operator holds: a new verb is a decision this test makes
# visible. Each is used by operator/ (or granted to routers, which RBAC allows only if held).
OPERATOR_RULES = {
    *{("serving.kvscale.io", "inferenceservices", v) for v in ("get", "list", "watch", "patch")},
    *{("serving.kvscale.io", "inferenceservices/status", v) for v in ("get", "patch")},
    *{("serving.kvscale.io", "inferenceservices/scale", v) for v in ("get", "patch")},
    ("serving.kvscale.io", "inferenceservices/finalizers", "update"),
    ("autoscaling", "horizontalpodautoscalers", "list"),
    *{("apps", "deployments", v) for v in ("get", "list", "watch", "create", "patch", "delete")},
    *{("", r, v) for r in ("services", "serviceaccounts") for v in ("get", "create", "patch", "delete")},
    *{("policy", "poddisruptionbudgets", v) for v in ("get", "create", "patch", "delete")},
    *{("rbac.authorization.k8s.io", r, v) for r in ("roles", "rolebindings")
      for v in ("get", "create", "patch", "delete")},
    *{("discovery.k8s.io", "endpointslices", v) for v in ("get", "list", "watch")},
    ("", "pods", "list"), ("", "pods", "patch"),
    ("", "secrets", "create"),
    ("", "events", "create"),
    *{("", "configmaps", v) for v in ("get", "create", "patch", "delete")},
    *{("inference.networking.k8s.io", "inferencepools", v) for v in ("get", "create", "patch", "delete")},
    *{("leaderworkerset.x-k8s.io", "leaderworkersets", v) for v in ("get", "create", "patch", "delete")},
}
POOL_RULES = {rule for rule in OPERATOR_RULES if rule[1] == "inferencepools"}
LWS_RULES = {rule for rule in OPERATOR_RULES if rule[1] == "leaderworkersets"}
# What the operator does in each namespace it serves (kubectl's resource spelling).
GRANTED = [
    ("list", "inferenceservices.serving.kvscale.io"), ("watch", "inferenceservices.serving.kvscale.io"),
    ("patch", "inferenceservices.serving.kvscale.io", "scale"),
    ("create", "deployments.apps"), ("patch", "deployments.apps"), ("delete", "deployments.apps"),
    ("create", "services"), ("create", "serviceaccounts"), ("create", "poddisruptionbudgets.policy"),
    ("create", "roles.rbac.authorization.k8s.io"), ("create", "rolebindings.rbac.authorization.k8s.io"),
    ("list", "pods"), ("patch", "pods"), ("create", "secrets"), ("create", "events"),
    ("list", "horizontalpodautoscalers.autoscaling"),
    *[(verb, "endpointslices.discovery.k8s.io") for verb in ENDPOINTSLICES_RULE["verbs"]],
    ("create", "configmaps"), ("patch", "configmaps"), ("delete", "configmaps"),
    *[(verb, "inferencepools.inference.networking.k8s.io") for verb in ("get", "create", "patch", "delete")],
    *[(verb, "leaderworkersets.leaderworkerset.x-k8s.io") for verb in ("get", "create", "patch", "delete")],
]
# What it never may, wherever it serves.
REFUSED_IN_SERVED = [
    ("get", "secrets"), ("list", "secrets"), ("watch", "secrets"), ("delete", "secrets"),
    ("update", "secrets"), ("patch", "secrets"),
    ("create", "pods"), ("delete", "pods"), ("update", "pods"), ("create", "pods", "exec"),
    # Its children by name only: it never lists other ConfigMaps.
    ("list", "configmaps"), ("watch", "configmaps"), ("deletecollection", "deployments.apps"),
    ("list", "inferencepools.inference.networking.k8s.io"),
    ("watch", "inferencepools.inference.networking.k8s.io"),
    ("list", "leaderworkersets.leaderworkerset.x-k8s.io"),
    ("watch", "leaderworkersets.leaderworkerset.x-k8s.io"),
    ("patch", "horizontalpodautoscalers.autoscaling"),
    ("escalate", "roles.rbac.authorization.k8s.io"), ("bind", "roles.rbac.authorization.k8s.io"),
    ("bind", "clusterroles.rbac.authorization.k8s.io"),
    ("update", "leases.coordination.k8s.io"),
]
# Cluster-scoped, in both modes.
REFUSED_CLUSTER = [
    ("create", "clusterroles.rbac.authorization.k8s.io"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
    ("update", "nodes"), ("create", "namespaces"), ("list", "customresourcedefinitions.apiextensions.k8s.io"),
    ("create", "validatingadmissionpolicies.admissionregistration.k8s.io"),
]


def operator_user(release: str, namespace: str) -> str:
    return f"system:serviceaccount:{namespace}:{release}-kvscale-operator"


def can(env, user: str, verb: str, resource: str, subresource: str = "",
        namespace: str | None = None, all_namespaces: bool = False) -> bool:
    args = ["auth", "can-i", verb, resource, f"--as={user}"]
    if subresource:
        args.append(f"--subresource={subresource}")
    if all_namespaces:
        args.append("--all-namespaces")
    elif namespace:
        args += ["-n", namespace]
    proc = env.kubectl(*args, check=False)
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), proc.stderr
    return answer == "yes"


def rendered(helm: Helm, release: str, namespace: str, *values: str,
             templates: tuple[str, ...] = ("serviceaccount.yaml", "rbac.yaml")) -> list[dict]:
    return helm.template("crds.install=false", *values, release=release, namespace=namespace,
                         show_only=[f"templates/{t}" for t in templates])


def held_rules(docs: list[dict], kind: str) -> set[tuple[str, str, str]]:
    """(group, resource, verb) of the operator's main Role or ClusterRole (not the Lease's)."""
    roles = [d for d in docs if d["kind"] == kind and not d["metadata"]["name"].endswith("-leader-election")]
    assert roles, kind
    sets = [{(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
             for resource in rule["resources"] for verb in rule["verbs"]} for role in roles]
    assert all(s == sets[0] for s in sets)  # the same rules in every namespace
    return sets[0]


def ensure_namespaces(env, *names: str) -> None:
    for name in names:
        if env.kubectl("get", "namespace", name, check=False).returncode != 0:
            env.kubectl("create", "namespace", name)


@pytest.fixture(scope="module")
def chart_rbac(helm, k8s_env) -> Iterator[dict[str, list[dict]]]:
    """Both modes applied side by side (different releases and ServiceAccounts)."""
    env = k8s_env
    # GIE's InferencePool and LWS's LeaderWorkerSet CRDs too: `kubectl auth can-i` names a
    # resource the API serves.
    pool_crd, lws_crd = inference_pool_crd(), leader_worker_set_crd()
    env.kubectl("apply", "-f", str(REPO_ROOT / "crds"), "-f", str(pool_crd))
    env.kubectl("apply", "--server-side", "-f", str(lws_crd))
    env.wait_established("inferencepools.inference.networking.k8s.io")
    env.wait_established("leaderworkersets.leaderworkerset.x-k8s.io")
    ensure_namespaces(env, CLUSTER_WIDE[1], NAMESPACED[1], *WATCHED, UNWATCHED, ANYWHERE)
    modes = {
        "cluster-wide": rendered(helm, *CLUSTER_WIDE),
        "namespaced": rendered(helm, *NAMESPACED, f"operator.watchNamespaces={{{','.join(WATCHED)}}}",
                               f"operator.allowedApiKeySecrets={{{','.join(KEY_SECRET_PATTERNS)}}}"),
    }
    for docs in modes.values():
        env.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    try:
        yield modes
    finally:
        for docs in modes.values():
            env.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-",
                        input=yaml.safe_dump_all(docs), check=False)
        for name in (CLUSTER_WIDE[1], NAMESPACED[1], *WATCHED, UNWATCHED, ANYWHERE):
            env.kubectl("delete", "namespace", name, "--wait=false", check=False)
        env.kubectl("delete", "-f", str(pool_crd), "--ignore-not-found", "--wait=false", check=False)
        env.kubectl("delete", "-f", str(lws_crd), "--ignore-not-found", "--wait=false", check=False)


def test_the_rules_held_are_the_rules_used(chart_rbac):
    assert held_rules(chart_rbac["cluster-wide"], "ClusterRole") == OPERATOR_RULES
    assert held_rules(chart_rbac["namespaced"], "Role") == OPERATOR_RULES


def test_inference_pool_disabled_drops_the_pool_rules(helm):
    """The chart's inferencePool.enabled false: the operator may not touch InferencePools."""
    for mode in ((), (f"operator.watchNamespaces={{{','.join(WATCHED)}}}",)):
        kind = "Role" if mode else "ClusterRole"
        release = NAMESPACED if mode else CLUSTER_WIDE
        assert held_rules(rendered(helm, *release, *mode, "inferencePool.enabled=false"), kind) \
            == OPERATOR_RULES - POOL_RULES


def test_leader_worker_set_disabled_drops_its_rules(helm):
    """The chart's leaderWorkerSet.enabled false: the operator may not touch LeaderWorkerSets."""
    for mode in ((), (f"operator.watchNamespaces={{{','.join(WATCHED)}}}",)):
        kind = "Role" if mode else "ClusterRole"
        release = NAMESPACED if mode else CLUSTER_WIDE
        assert held_rules(rendered(helm, *release, *mode, "leaderWorkerSet.enabled=false"), kind) \
            == OPERATOR_RULES - LWS_RULES


def test_cluster_wide_mode(chart_rbac, k8s_env):
    user = operator_user(*CLUSTER_WIDE)
    for namespace in (ANYWHERE, UNWATCHED):
        for verb, resource, *sub in GRANTED:
            assert can(k8s_env, user, verb, resource, *sub, namespace=namespace), (verb, resource, namespace)
    for namespace in (ANYWHERE, "kube-system", "default"):
        for verb, resource, *sub in REFUSED_IN_SERVED:
            assert not can(k8s_env, user, verb, resource, *sub, namespace=namespace), (verb, resource, namespace)
    assert not can(k8s_env, user, "get", "secrets", namespace="kube-system")
    assert not can(k8s_env, user, "list", "secrets", all_namespaces=True)
    for verb, resource in REFUSED_CLUSTER:
        assert not can(k8s_env, user, verb, resource), (verb, resource)


def test_watch_namespaces_mode_grants_nothing_elsewhere(chart_rbac, k8s_env):
    docs = chart_rbac["namespaced"]
    assert not [d["kind"] for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] == "RoleBinding"} == {
        *WATCHED, NAMESPACED[1]}
    user = operator_user(*NAMESPACED)
    for namespace in WATCHED:
        for verb, resource, *sub in GRANTED:
            assert can(k8s_env, user, verb, resource, *sub, namespace=namespace), (verb, resource, namespace)
        for verb, resource, *sub in REFUSED_IN_SERVED:
            assert not can(k8s_env, user, verb, resource, *sub, namespace=namespace), (verb, resource, namespace)
    # Nothing at all in an unwatched namespace, kube-system or its own (but the Lease).
    for namespace in (UNWATCHED, "kube-system", NAMESPACED[1]):
        for verb, resource, *sub in GRANTED:
            assert not can(k8s_env, user, verb, resource, *sub, namespace=namespace), (verb, resource, namespace)
    assert not can(k8s_env, user, "get", "secrets", namespace="kube-system")
    assert not can(k8s_env, user, "patch", "pods", namespace=UNWATCHED)
    assert not can(k8s_env, user, "list", "inferenceservices.serving.kvscale.io", all_namespaces=True)
    assert can(k8s_env, user, "update", "leases.coordination.k8s.io", "", namespace=NAMESPACED[1]) is False
    assert k8s_env.kubectl("auth", "can-i", "update", "leases.coordination.k8s.io/rbac-ns-kvscale-operator",
                           "-n", NAMESPACED[1], f"--as={user}", check=False).stdout.strip() == "yes"
    for verb, resource in REFUSED_CLUSTER:
        assert not can(k8s_env, user, verb, resource), (verb, resource)


@pytest.mark.parametrize("mode", ["cluster-wide", "namespaced"])
def test_it_can_grant_a_router_its_role_and_nothing_more(chart_rbac, k8s_env, mode):
    """RBAC's escalation check, for real: a Role with the router's rules is accepted, one that
    reads Secrets (which the operator does not hold) is refused."""
    release, namespace = CLUSTER_WIDE if mode == "cluster-wide" else NAMESPACED
    user = operator_user(release, namespace)
    target = ANYWHERE if mode == "cluster-wide" else WATCHED[0]

    def create_role(name: str, rules: list[dict]) -> subprocess.CompletedProcess[str]:
        # Labelled and owned as the operator's children are: the chart's children policy
        # (test_it_creates_only_what_an_inference_service_is_made_of) is not what is tried here.
        role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                "metadata": kvscale_meta(name, target, NO_OWNER_UID), "rules": rules}
        return k8s_env.kubectl("create", "-f", "-", f"--as={user}", input=json.dumps(role), check=False)

    router_role = create_role(f"{release}-like-router", [dict(ENDPOINTSLICES_RULE)])
    assert router_role.returncode == 0, router_role.stderr
    reader = create_role(f"{release}-reader-router", [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}])
    assert reader.returncode != 0
    assert "attempting to grant RBAC permissions not currently held" in reader.stderr
    k8s_env.kubectl("delete", "role", f"{release}-like-router", "-n", target, check=False)


@pytest.mark.parametrize("mode", ["cluster-wide", "namespaced"])
def test_its_pod_patches_may_change_the_deletion_cost_and_nothing_else(chart_rbac, k8s_env, mode):
    release, namespace = CLUSTER_WIDE if mode == "cluster-wide" else NAMESPACED
    user = operator_user(release, namespace)
    target = ANYWHERE if mode == "cluster-wide" else WATCHED[1]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": f"{release}-victim", "namespace": target, "labels": {"app": "web"},
                        "annotations": {"note": "kept"}},
           "spec": {"containers": [{"name": "c", "image": "registry.invalid/none:1"}],
                    "tolerations": [kwok_toleration()]}}
    k8s_env.kubectl("create", "-f", "-", input=json.dumps(pod))
    try:
        name = pod["metadata"]["name"]

        path = path_for("v1", "pods", target, name)
        # The operator's own client and its merge patch (operator/deletion_cost.py), under the
        # ServiceAccount's identity (kubectl patch would `get` the pod first, which it may not).
        kube = Kube(load_connection(str(k8s_env.kubeconfig_for_service_account(namespace, user.rsplit(":", 1)[1]))))
        try:
            kube.merge_patch(path, {"metadata": {"annotations": {DELETION_COST_ANNOTATION: "7"}}})
            for attempt in ({"labels": {"app": "stolen"}}, {"labels": {"serving.kvscale.io/router": "chat"}},
                            {"annotations": {"note": "changed"}}, {"annotations": {"note": None}},
                            {"finalizers": ["example.com/hold"]}):
                with pytest.raises(ApiError) as refused:
                    kube.merge_patch(path, {"metadata": attempt})
                assert refused.value.status == 403, attempt
                assert "pod-deletion-cost annotation and nothing else" in refused.value.message
        finally:
            kube.close()
        live = k8s_env.kubectl_json("get", "pod", name, "-n", target)["metadata"]
        assert live["labels"] == {"app": "web"}
        assert live["annotations"] == {"note": "kept", DELETION_COST_ANNOTATION: "7"}
        # Anyone else is not bound by the policy.
        k8s_env.kubectl("label", "pod", name, "-n", target, "app=web2", "--overwrite")
    finally:
        k8s_env.kubectl("delete", "pod", pod["metadata"]["name"], "-n", target, "--wait=false",
                        "--grace-period=0", "--force", check=False)


def test_the_operator_serves_its_namespaces_under_the_namespaced_rbac(chart_rbac, helm, k8s_env, tmp_path):
    """Not only can-i: `kvscale operator` with the chart's args, under a real token of the
    ServiceAccount, reconciles an InferenceService in a watched namespace without one 403
    (kopf lists no CRDs or namespaces), creates its Redis Secret once and leaves the
    unwatched namespace alone."""
    env = k8s_env
    release, namespace = NAMESPACED
    values = (f"operator.watchNamespaces={{{','.join(WATCHED)}}}",)
    (deployment,) = [d for d in rendered(helm, release, namespace, *values, templates=("operator.yaml",))
                     if d["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert [a for a in container["args"] if a.startswith("--namespace")] == [
        f"--namespace={ns}" for ns in WATCHED]
    pod_env = {"POD_NAME": "rbac-ns-operator-local", "POD_NAMESPACE": namespace}
    args = [a.replace("$(POD_NAMESPACE)", namespace) for a in container["args"]]
    kubeconfig = env.kubeconfig_with_token(namespace, deployment["spec"]["template"]["spec"]["serviceAccountName"])
    log_path = tmp_path / "operator.log"

    def inference_service(ns: str) -> dict:
        return {"apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
                "metadata": {"name": "chat", "namespace": ns},
                "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"},
                         "resources": {"gpus": 1, "cpu": "1", "memory": "2Gi"},
                         "tolerations": [kwok_toleration()]}}

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvscale", *args, f"--kubeconfig={kubeconfig}",
             f"--metrics-port={free_port()}", "--resync-interval=1", "--scrape-interval=1"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **pod_env},
            preexec_fn=die_with_parent)
    try:
        env.kubectl("apply", "-f", "-", input=json.dumps(inference_service(WATCHED[0])))
        env.kubectl("apply", "-f", "-", input=json.dumps(inference_service(UNWATCHED)))

        def reconciled() -> bool:
            status = env.kubectl_json("get", "inferenceservice", "chat", "-n", WATCHED[0]).get("status") or {}
            return "Ready" in {c["type"] for c in status.get("conditions") or []}

        wait_until(reconciled, 90, interval=1.0,
                   what=f"chat reconciled; operator log:\n{log_path.read_text(errors='replace')[-3000:]}")
        for kind, name in (("deployment", "chat"), ("deployment", "chat-router"), ("role", "chat-router"),
                           ("rolebinding", "chat-router"), ("deployment", "chat-redis"),
                           ("secret", "chat-redis")):
            assert env.kubectl("get", kind, name, "-n", WATCHED[0], check=False).returncode == 0, (kind, name)
        secret = env.kubectl_json("get", "secret", "chat-redis", "-n", WATCHED[0])
        # Several resyncs (1 s) later the Secret is the one first made (409: kept, never read).
        time.sleep(4)
        assert env.kubectl_json("get", "secret", "chat-redis", "-n", WATCHED[0])["data"] == secret["data"]
        assert env.kubectl("get", "deployment", "chat", "-n", UNWATCHED, check=False).returncode != 0
        log_text = log_path.read_text(errors="replace")
        assert "forbidden" not in log_text.lower(), log_text[-3000:]
        assert proc.poll() is None, log_text[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for ns in (WATCHED[0], UNWATCHED):
            env.kubectl("delete", "inferenceservice", "chat", "-n", ns, "--wait=false", check=False)


# What RBAC would allow it (it holds create deployments, services, roles, rolebindings) and the
# chart's children policy refuses: what an InferenceService's children are not.
CAN_I_REFUSED = [
    ("impersonate", "serviceaccounts"), ("impersonate", "users"), ("create", "serviceaccounts", "token"),
    ("update", "pods", "ephemeralcontainers"), ("get", "nodes", "proxy"),
    ("escalate", "clusterroles.rbac.authorization.k8s.io"), ("update", "deployments.apps", "scale"),
]


@pytest.mark.parametrize("mode", ["cluster-wide", "namespaced"])
def test_what_it_may_never_do_however_it_asks(chart_rbac, k8s_env, mode):
    release, namespace = CLUSTER_WIDE if mode == "cluster-wide" else NAMESPACED
    user = operator_user(release, namespace)
    target = ANYWHERE if mode == "cluster-wide" else WATCHED[0]
    for verb, resource, *sub in CAN_I_REFUSED:
        assert not can(k8s_env, user, verb, resource, *sub, namespace=target), (verb, resource, sub)


# For objects only created to see whether a create passes: the garbage collector may remove them.
NO_OWNER_UID = "00000000-0000-0000-0000-000000000001"


def kvscale_meta(name: str, namespace: str, owner_uid: str, component: str = "router") -> dict:
    """Labels and owner of a child the operator makes (operator/children/labels.py, apply.owned)."""
    return {"name": name, "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "kvscale-operator",
                       "app.kubernetes.io/component": component, "serving.kvscale.io/router": "probe"},
            "ownerReferences": [{"apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
                                 "name": "probe", "uid": owner_uid,
                                 "controller": True}]}


def deployment(name: str, namespace: str, owner_uid: str,
               image: str = "ghcr.io/kvscale/kvscale-control-plane:0.1.0", **pod: object) -> dict:
    meta = kvscale_meta(name, namespace, owner_uid)
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": 0, "selector": {"matchLabels": {"serving.kvscale.io/router": "probe"}},
                     "template": {"metadata": {"labels": dict(meta["labels"])},
                                  "spec": {"containers": [{"name": "c", "image": image}], **pod}}}}


@pytest.mark.parametrize("mode", ["cluster-wide", "namespaced"])
def test_it_creates_only_what_an_inference_service_is_made_of(chart_rbac, k8s_env, mode):
    """The children policy, for real, under the operator's identity: a router's account, Role and
    binding pass; another account's pods, a foreign image, a binding of a ClusterRole, a Role
    reading more, an unlabelled Service repointed: all refused though RBAC allows each."""
    release, namespace = CLUSTER_WIDE if mode == "cluster-wide" else NAMESPACED
    user = operator_user(release, namespace)
    target = ANYWHERE if mode == "cluster-wide" else WATCHED[0]
    kube = Kube(load_connection(str(k8s_env.kubeconfig_for_service_account(namespace, user.rsplit(":", 1)[1]))))
    made: list[str] = ["inferenceservice/probe"]
    # A real owner: children of an owner that does not exist are the garbage collector's to delete,
    # and a Role gone before its RoleBinding is created fails that create with a 404.
    k8s_env.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "probe", "namespace": target},
        "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"}, "replicas": 0}}))
    uid = k8s_env.kubectl_json("get", "inferenceservice", "probe", "-n", target)["metadata"]["uid"]

    def meta(name: str) -> dict:
        return kvscale_meta(name, target, uid)

    def create(obj: dict) -> None:
        kube.create(path_for(obj["apiVersion"], {"Deployment": "deployments", "Role": "roles",
                                                 "RoleBinding": "rolebindings", "Service": "services",
                                                 "ServiceAccount": "serviceaccounts"}[obj["kind"]], target), obj)
        made.append(f"{obj['kind'].lower()}/{obj['metadata']['name']}")

    def refused(obj: dict, words: str) -> None:
        with pytest.raises(ApiError) as error:
            create(obj)
        assert error.value.status in (403, 422) and words in error.value.message, error.value.message

    rbac_group = "rbac.authorization.k8s.io/v1"
    try:
        # What a router is made of passes.
        create({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta("probe-router")})
        create({"apiVersion": rbac_group, "kind": "Role", "metadata": meta("probe-router"),
                "rules": [dict(ENDPOINTSLICES_RULE)]})
        create({"apiVersion": rbac_group, "kind": "RoleBinding", "metadata": meta("probe-router"),
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "probe-router"},
                "subjects": [{"kind": "ServiceAccount", "name": "probe-router", "namespace": target}]})
        create(deployment("probe-router", target, uid, serviceAccountName="probe-router"))
        # Its own rules (ClusterRole, or Role in the namespaced mode) bound to anyone: RBAC allows
        # it, the operator holding those rules.
        refused({"apiVersion": rbac_group, "kind": "RoleBinding", "metadata": meta("x-router"),
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                             "kind": "ClusterRole" if mode == "cluster-wide" else "Role",
                             "name": f"{release}-kvscale-operator"},
                 "subjects": [{"kind": "User", "name": "mallory"}]}, "binds its own Role")
        refused({"apiVersion": rbac_group, "kind": "Role", "metadata": meta("y-router"),
                 "rules": [{"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["create"]}]},
                "reads EndpointSlices")
        refused({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta("admin")},
                "NAME-router")
        # Pods as another account, from a foreign image, on the host.
        refused(deployment("a-router", target, uid, serviceAccountName="default"), "own ServiceAccount")
        refused(deployment("b-router", target, uid, image="docker.io/attacker/miner:1"), "allowed images")
        refused(deployment("c-router", target, uid, hostNetwork=True), "no host namespace")
        unlabelled = deployment("d-router", target, uid)
        del unlabelled["metadata"]["labels"]["app.kubernetes.io/managed-by"]
        refused(unlabelled, "managed-by=kvscale-operator")
        # An API key fed from a Secret: only from the allowed ones where a list is in force.
        def keyed(name: str, secret: str, env: str = "KVSCALE_API_KEY") -> dict:
            keyed = deployment(name, target, uid)
            keyed["spec"]["template"]["spec"]["containers"][0]["env"] = [
                {"name": env, "valueFrom": {"secretKeyRef": {"name": secret, "key": "api-key"}}}]
            return keyed

        create(keyed("e-router", "team-api-key"))
        create(keyed("f-router", "team.key1", env="KVSCALE_REPLICA_API_KEY"))
        if mode == "namespaced":  # "." is no wildcard, "?" one character, the whole name matched
            for n, secret in enumerate(("db-password", "teamxkey1", "team.key12", "team-api-key-old")):
                refused(keyed(f"g{n}-router", secret), "allowed Secrets")
            from_all = deployment("h-router", target, uid)
            from_all["spec"]["template"]["spec"]["containers"][0]["envFrom"] = [{"secretRef": {"name": "db-password"}}]
            refused(from_all, "allowed Secrets")
        else:
            create(keyed("g-router", "db-password"))
        # A user's Service: the operator may not repoint it (traffic theft) nor delete it.
        web = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": target},
               "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}}
        k8s_env.kubectl("apply", "-f", "-", input=json.dumps(web))
        with pytest.raises(ApiError) as stolen:
            kube.merge_patch(path_for("v1", "services", target, "web"),
                             {"spec": {"selector": {"serving.kvscale.io/router": "probe"}}})
        assert stolen.value.status == 403, stolen.value.message
        with pytest.raises(ApiError) as deleted:
            kube.delete(path_for("v1", "services", target, "web"))
        assert deleted.value.status == 403, deleted.value.message
        assert k8s_env.kubectl_json("get", "service", "web", "-n", target)["spec"]["selector"] == {"app": "web"}
    finally:
        kube.close()
        for what in [*made, "service/web"]:
            k8s_env.kubectl("delete", what, "-n", target, "--wait=false", check=False)
