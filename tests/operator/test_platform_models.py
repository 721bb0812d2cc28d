"""Prefix routing for every model source, on the whole platform.

Three InferenceServices at once, each with one server, its router and its Redis, all real
processes on the process runtime: an `hf://` model fetched from a local stand-in for the Hub
(tests/operator/hub.py; the runtime's image points HF_ENDPOINT at it, as a cluster with a Hub
mirror would), the bundled model under a `servedName`, and a `pvc://` model on a claim bound to a
hostPath PersistentVolume. For each, the router must predict the prefix hits the server then
counts (within one block), never fall back for want of a tokenizer, and the InferenceService
must say PrefixRouting=True.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hub import HubStandIn
from metrics_text import samples
from operator_helpers import install_operator
from prefix_hits import assert_predicted_hits_counted
from testenv import kwok_toleration, ready_pods

from kvscale.base_urls import base_url
from kvscale.metric_names import (
    ROUTER_FALLBACKS,
    ROUTER_TOKENIZER_LOADED,
)
from kvscale.model_files import resolve_model_path
from kvscale.processes import wait_until

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "team-models"
READY_TIMEOUT_S = 600.0  # three model loads (one after a 0.5 GB fetch) on a shared 2-core machine
BLOCK_SIZE = 16
# name -> (spec.model, the name the servers answer to)
SOURCES: dict[str, tuple[dict[str, str], str]] = {
    "hub": ({"uri": "hf://org/smollm2"}, "smollm2"),
    "named": ({"uri": "bundled://smollm2-135m-instruct", "servedName": "house-chat"}, "house-chat"),
    "claim": ({"uri": "pvc://weights/models/smol"}, "smol"),
}


def inference_service(name: str, model: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "serving.kvscale.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": model,
            "replicas": 1,
            "resources": {"gpus": 1, "cpu": "1", "memory": "2Gi"},
            "engine": {"maxModelLen": 2048, "maxNumSeqs": 8, "maxNumBatchedTokens": 512,
                       "dtype": "float32", "blockSize": BLOCK_SIZE},
            "router": {"replicas": 1},
            "tolerations": [kwok_toleration()],
        },
    }


def claim_objects(model_root: Path) -> list[dict[str, Any]]:
    """A hostPath PersistentVolume holding the model, and the claim bound to it."""
    return [
        {"apiVersion": "v1", "kind": "PersistentVolume",
         "metadata": {"name": f"{NAMESPACE}-weights"},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                  "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                  "hostPath": {"path": str(model_root), "type": "Directory"}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
         "metadata": {"name": "weights", "namespace": NAMESPACE},
         "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "",
                  "volumeName": f"{NAMESPACE}-weights", "resources": {"requests": {"storage": "1Gi"}}}},
    ]


@dataclasses.dataclass
class ModelsPlatform:
    cluster: Any  # tests/conftest.py's ProcessCluster
    hub: HubStandIn

    def get(self, *args: str) -> dict[str, Any]:
        return self.cluster.env.kubectl_json("get", *args)

    def ready_pods(self, selector: str) -> list[dict[str, Any]]:
        return ready_pods(self.cluster.env, NAMESPACE, selector)

    def url(self, name: str, component: str) -> str:
        if component == "router":
            (pod,) = self.ready_pods(f"serving.kvscale.io/router={name}")
            return base_url(pod["status"]["podIP"], 8080)
        (pod,) = self.ready_pods(f"serving.kvscale.io/inferenceservice={name}")
        return base_url(pod["status"]["podIP"], 8000)

    def status(self, name: str) -> dict[str, Any]:
        return self.get("inferenceservice", name, "-n", NAMESPACE).get("status") or {}

    def diagnose(self) -> str:
        runtime = self.cluster.runtime
        pods = self.get("pods", "-n", NAMESPACE)["items"]
        logs = "\n".join(f"--- {p['metadata']['name']}\n" + runtime.log_tail(NAMESPACE, p["metadata"]["name"])
                         for p in pods if (NAMESPACE, p["metadata"]["name"]) in runtime.workers)
        statuses = {name: self.status(name) for name in SOURCES}
        return f"{json.dumps(statuses)}\n{logs}"


@pytest.fixture(scope="module")
def models_platform(process_cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelsPlatform]:
    env, runtime = process_cluster.env, process_cluster.runtime
    converted = resolve_model_path(None)  # the bundled model as HF files: what the Hub holds
    model_root = tmp_path_factory.mktemp("pv")
    (model_root / "models").mkdir()
    (model_root / "models" / "smol").symlink_to(converted, target_is_directory=True)
    # Where the pods reach this machine: the node's address, not a loopback of their own.
    hub = HubStandIn({"org/smollm2": converted}, host=runtime.host_ip).start()
    image = runtime.images["kvscale"]
    runtime.images["kvscale"] = dataclasses.replace(image, env={**image.env, "HF_ENDPOINT": hub.url})
    install_operator(env, NAMESPACE)
    platform = ModelsPlatform(process_cluster, hub)
    try:
        for manifest in [*claim_objects(model_root),
                         *(inference_service(name, model) for name, (model, _) in SOURCES.items())]:
            env.kubectl("apply", "-f", "-", input=json.dumps(manifest))

        def all_ready() -> bool:
            for name in SOURCES:
                status = platform.status(name)
                conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
                if not (conditions.get("Ready") == "True" and status.get("readyReplicas") == 1
                        and (status.get("router") or {}).get("readyReplicas", 0) >= 1):
                    return False
            return True

        try:
            wait_until(all_ready, READY_TIMEOUT_S, interval=2.0, what="three InferenceServices Ready")
        except TimeoutError:
            raise AssertionError(f"not ready: {platform.diagnose()}") from None
        yield platform
    finally:
        env.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
        env.kubectl("delete", "persistentvolume", f"{NAMESPACE}-weights", "--wait=false", check=False)
        runtime.images["kvscale"] = image
        hub.stop()


LONG_PROMPT = "Ledger of the harbour: " + " ".join(
    f"ship {n} carried {n * 7 % 13} crates of {('salt', 'tea', 'iron', 'wool')[n % 4]};" for n in range(40))


@pytest.mark.parametrize("name", list(SOURCES))
def test_the_router_predicts_the_hits_the_server_counts(models_platform: ModelsPlatform, name: str) -> None:
    served = SOURCES[name][1]
    router, server = models_platform.url(name, "router"), models_platform.url(name, "server")
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0, timeout=120)

    prompt = f"{LONG_PROMPT} ({name})"
    assert_predicted_hits_counted(client, served, prompt, [server], block_size=BLOCK_SIZE, settle_s=1.5)
    # Chat goes through the same tokenizer's chat template.
    messages = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=served, messages=messages, max_tokens=1, temperature=0)
    time.sleep(1.5)
    chat = client.chat.completions.with_raw_response.create(model=served, messages=messages,
                                                            max_tokens=1, temperature=0)
    assert int(chat.headers["x-kvscale-predicted-hit-tokens"]) > 0

    metrics = httpx.get(router + "/metrics", timeout=5).text
    assert samples(metrics, ROUTER_FALLBACKS.series)['{reason="no_tokenizer"}'] == 0.0
    assert samples(metrics, ROUTER_TOKENIZER_LOADED.series) == {f'{{model_name="{served}"}}': 1.0}

    def prefix_routing() -> dict[str, Any] | None:
        conditions = {c["type"]: c for c in models_platform.status(name).get("conditions", [])}
        condition = conditions.get("PrefixRouting")
        return condition if condition and condition["status"] != "Unknown" else None

    condition = wait_until(prefix_routing, 60, interval=1.0, what=f"{name}'s PrefixRouting condition")
    assert (condition["status"], condition["reason"]) == ("True", "TokenizersLoaded"), condition
