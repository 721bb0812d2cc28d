"""No password, API key or token on a command line, in a pod's plain values, a log, an Event or a
status, on the whole platform; and a missing API-key Secret reported from the
pods' status, the operator reading no Secret.

As in test_platform.py: `kubectl apply` of the CRD and deploy/*.yaml, every pod a real process
(tests/cluster/kubelet.py). One InferenceService with an API key and the operator's own Redis is
created before its key's Secret exists, then served; the generated Redis password and the API key
are then searched for everywhere they must not be.
"""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from kubelet import container_env, expand
from testenv import kwok_toleration, ready_pods

from kvscale.operator.kube import Kube, load_connection
from kvscale.processes import wait_until

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "team-secrets"
OPERATOR_NAMESPACE = "kvscale-system"
MODEL = "smollm2-135m-instruct"
NAME = "guarded"
KEY_SECRET = "guarded-key"
READY_TIMEOUT_S = 420.0


def guarded_service() -> dict[str, Any]:
    return {
        "apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"uri": f"bundled://{MODEL}"},
            "replicas": 1,
            "apiKeySecretRef": {"name": KEY_SECRET},
            "resources": {"gpus": 1, "cpu": "1", "memory": "2Gi"},
            "engine": {"maxModelLen": 2048, "maxNumSeqs": 8, "maxNumBatchedTokens": 512,
                       "dtype": "float32"},
            "tolerations": [kwok_toleration()],
        },
    }


@pytest.fixture(scope="module")
def cluster(process_cluster) -> Iterator[Any]:
    env = process_cluster.env
    env.kubectl("apply", "-f", str(REPO_ROOT / "crds"), "-f", str(REPO_ROOT / "deploy" / "rbac.yaml"))
    env.kubectl("apply", "-f", str(REPO_ROOT / "deploy" / "operator.yaml"))
    env.kubectl("create", "namespace", NAMESPACE)
    yield process_cluster
    env.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def conditions_of(env, name: str) -> dict[str, dict[str, Any]]:
    status = env.kubectl_json("get", "inferenceservice", name, "-n", NAMESPACE).get("status") or {}
    return {c["type"]: c for c in status.get("conditions") or []}


def plain_values(pod: dict[str, Any]) -> list[str]:
    """What a pod spec says in clear: command, args and literal env values of every container."""
    containers = [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]
    return [text for c in containers for text in (
        *(c.get("command") or []), *(c.get("args") or []),
        *(var["value"] for var in c.get("env") or [] if "value" in var))]


def expanded_argv(kube: Kube, pod: dict[str, Any]) -> list[str]:
    """The command lines a kubelet starts: args with $(VAR) expanded from the env (Secrets too)."""
    argv: list[str] = []
    for container in [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]:
        values = container_env(kube, pod, container)
        argv += [expand(a, values) for a in (container.get("command") or []) + (container.get("args") or [])]
    return argv


def test_a_missing_key_secret_then_nothing_secret_anywhere(cluster) -> None:
    env, runtime = cluster.env, cluster.runtime
    env.kubectl("apply", "-f", "-", input=json.dumps(guarded_service()))

    # 1. No Secret yet: the server and router pods cannot start, and the operator says why from
    # their status (it may not read Secrets).
    wait_until(lambda: conditions_of(env, NAME).get("Ready", {}).get("reason") == "SecretNotFound",
               120, interval=1.0, what=f"Ready=False SecretNotFound: {conditions_of(env, NAME)}")
    ready = conditions_of(env, NAME)["Ready"]
    assert ready["status"] == "False" and KEY_SECRET in ready["message"], ready

    def warned() -> bool:
        events = env.kubectl_json("get", "events", "-n", NAMESPACE)["items"]
        return any(e["type"] == "Warning" and e["reason"] == "SecretNotFound"
                   and e["involvedObject"].get("kind") == "InferenceService" for e in events)

    wait_until(warned, 60, interval=1.0, what="a SecretNotFound Warning event")

    # 2. The Secret appears: the pods start and the service is Ready; the key is required.
    api_key = "sk-" + secrets.token_urlsafe(24)
    env.kubectl("create", "secret", "generic", KEY_SECRET, "-n", NAMESPACE, f"--from-literal=api-key={api_key}")

    def serving() -> bool:
        status = env.kubectl_json("get", "inferenceservice", NAME, "-n", NAMESPACE).get("status") or {}
        return (conditions_of(env, NAME).get("Ready", {}).get("status") == "True"
                and (status.get("router") or {}).get("readyReplicas", 0) >= 1)

    wait_until(serving, READY_TIMEOUT_S, interval=2.0, what=f"{NAME} Ready: {conditions_of(env, NAME)}")
    (router, *_) = ready_pods(env, NAMESPACE, f"serving.kvscale.io/router={NAME}")
    base = f"http://{router['status']['podIP']}:8080/v1"
    client = openai.OpenAI(base_url=base, api_key=api_key, max_retries=0, timeout=120)
    assert client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                     temperature=0).choices[0].text
    streamed = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0, stream=True,
        messages=[{"role": "user", "content": "Say hi"}]) if c.choices]
    assert "".join(streamed)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0, timeout=30).models.list()

    # 3. The generated Redis password and the API key, searched for where they must not be.
    secret = env.kubectl_json("get", "secret", f"{NAME}-redis", "-n", NAMESPACE)
    password = base64.b64decode(secret["data"]["password"]).decode()
    needles = {"the Redis password": password, "the API key": api_key}
    kube = Kube(load_connection(str(env.kubeconfig)))
    found: list[str] = []
    try:
        for namespace in (NAMESPACE, OPERATOR_NAMESPACE):
            pods = env.kubectl_json("get", "pods", "-n", namespace)["items"]
            assert pods, namespace
            for pod in pods:
                where = f"pod {namespace}/{pod['metadata']['name']}"
                clear = "\n".join(plain_values(pod))
                argv = "\n".join(expanded_argv(kube, pod))
                found += [f"{what} in {where}'s spec" for what, s in needles.items() if s in clear]
                found += [f"{what} in {where}'s command line" for what, s in needles.items() if s in argv]
                found += [f"{what} in {where}'s status" for what, s in needles.items()
                          if s in json.dumps(pod.get("status"))]
    finally:
        kube.close()
    for (namespace, name), pid in runtime.pids().items():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except FileNotFoundError:
            continue  # restarted meanwhile
        found += [f"{what} in /proc/{pid}/cmdline ({namespace}/{name})"
                  for what, s in needles.items() if s in cmdline]
    logged = [key for key in runtime.workers if key[0] in (NAMESPACE, OPERATOR_NAMESPACE)]
    assert any(ns == OPERATOR_NAMESPACE for ns, _ in logged)  # the operator's own log is read too
    for namespace, name in logged:
        log = runtime.log_tail(namespace, name, lines=1_000_000)
        found += [f"{what} in the log of {namespace}/{name}" for what, s in needles.items() if s in log]
    events = env.kubectl("get", "events", "-A", "-o", "json").stdout
    found += [f"{what} in an Event" for what, s in needles.items() if s in events]
    services = env.kubectl("get", "inferenceservices", "-A", "-o", "json").stdout
    found += [f"{what} in an InferenceService" for what, s in needles.items() if s in services]
    assert found == []
