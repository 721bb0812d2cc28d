"""A replica over several nodes (engine.nodes > 1): the LeaderWorkerSet in place of the servers'
Deployment, its leader and worker templates, and what the other children select (docs/operator.md,
"A replica over several nodes"), from the spec alone."""

from __future__ import annotations

from typing import Any

import pytest

from kvscale.operator.children import leader_worker_set as lws
from kvscale.operator.children.labels import (
    NAME_LABEL,
    RANKS_LABEL,
    headless_service_name,
    selector_labels,
)
from kvscale.operator.children.owned import build_children, unwanted_children
from kvscale.operator.children.servers import server_default_flags
from kvscale.operator.config import OperatorConfig
from kvscale.operator.spec import parse_spec
from kvscale.operator.tensor_parallel import refusal

KV_POOL = ["--num-gpu-blocks-override", "4096"]


def spec_of(nodes: int = 2, gpus: int = 4, replicas: int = 3, *extra: str, **more: Any):
    return parse_spec({"model": {"uri": "hf://org/llama"}, "replicas": replicas,
                       "resources": {"gpus": gpus}, "engine": {"nodes": nodes, "extraArgs": [*KV_POOL, *extra]},
                       **more})


def children(spec) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in build_children("chat", "ns", spec)}


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, (name, args)
    return args[args.index(name) + 1]


def test_several_nodes_make_a_leader_worker_set_and_no_deployment():
    made = children(spec_of())
    assert ("Deployment", "chat") not in made
    obj = made[("LeaderWorkerSet", "chat-ranks")]
    assert obj["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert obj["spec"]["replicas"] == 3
    template = obj["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    # The workers start with the leader: it is ready only once they have joined.
    assert obj["spec"]["startupPolicy"] == "LeaderCreated"


def test_the_leader_serves_with_every_rank_counted():
    template = children(spec_of())[("LeaderWorkerSet", "chat-ranks")]["spec"]["leaderWorkerTemplate"]
    [leader] = template["leaderTemplate"]["spec"]["containers"]
    args = leader["args"]
    assert args[0] == "serve"
    assert flag(args, "--tensor-parallel-size") == "8"  # 2 nodes x 4 GPUs
    assert flag(args, "--nnodes") == "2"
    assert flag(args, "--node-rank") == "0"
    assert flag(args, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
    assert flag(args, "--master-port") == str(lws.MASTER_PORT)
    assert "--headless" not in args
    assert leader["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert {"readinessProbe", "livenessProbe", "startupProbe", "ports"} <= set(leader)
    labels = template["leaderTemplate"]["metadata"]["labels"]
    assert labels[NAME_LABEL] == "chat" and labels[RANKS_LABEL] == "chat"


def test_a_worker_runs_the_same_flags_headless_without_http():
    template = children(spec_of())[("LeaderWorkerSet", "chat-ranks")]["spec"]["leaderWorkerTemplate"]
    [leader] = template["leaderTemplate"]["spec"]["containers"]
    [worker] = template["workerTemplate"]["spec"]["containers"]
    assert flag(worker["args"], "--node-rank") == "$(LWS_WORKER_INDEX)"
    assert "--headless" in worker["args"]
    # The same model and flags as the leader's, but for its rank and --headless.
    strip = {"--node-rank", "0", "$(LWS_WORKER_INDEX)", "--headless"}
    assert [a for a in worker["args"] if a not in strip] == [a for a in leader["args"] if a not in strip]
    assert worker["image"] == leader["image"]
    assert worker["resources"] == leader["resources"]
    # No HTTP server: nothing to probe, no port, no endpoint to leave before SIGTERM.
    assert not {"readinessProbe", "livenessProbe", "startupProbe", "ports", "lifecycle"} & set(worker)
    labels = template["workerTemplate"]["metadata"]["labels"]
    # Not the servers' label: no Service, router, scrape or status selects a worker.
    assert NAME_LABEL not in labels and labels[RANKS_LABEL] == "chat"
    assert labels["app.kubernetes.io/component"] == "inference-server-worker"
    assert "annotations" not in template["workerTemplate"]["metadata"]  # not scraped


def test_both_templates_take_the_key_from_its_secret_and_never_in_clear():
    made = children(spec_of())
    template = made[("LeaderWorkerSet", "chat-ranks")]["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        [container] = template[role]["spec"]["containers"]
        [key] = [e for e in container["env"] if e["name"] == "KVSCALE_TP_AUTHKEY"]
        assert key == {"name": "KVSCALE_TP_AUTHKEY", "valueFrom": {"secretKeyRef": {
            "name": "chat-tp-authkey", "key": "authkey"}}}
    assert ("Secret", "chat-tp-authkey") not in made  # created once, apart (apply.py)
    secret = lws.build_authkey_secret("chat", "ns")
    other = lws.build_authkey_secret("chat", "ns")
    assert len(secret["stringData"]["authkey"]) >= 32
    assert secret["stringData"]["authkey"] != other["stringData"]["authkey"]


def test_only_leaders_are_selected_and_every_rank_is_counted_by_the_pdb():
    made = children(spec_of())
    assert made[("Service", headless_service_name("chat"))]["spec"]["selector"] == selector_labels("chat")
    assert made[("PodDisruptionBudget", "chat")]["spec"]["selector"]["matchLabels"] == {RANKS_LABEL: "chat"}
    one_node = children(spec_of(nodes=1, gpus=4))
    assert one_node[("PodDisruptionBudget", "chat")]["spec"]["selector"]["matchLabels"] == selector_labels("chat")


def test_dev_shm_holds_the_pods_own_ranks():
    template = children(spec_of(nodes=2, gpus=4))[("LeaderWorkerSet", "chat-ranks")]["spec"][
        "leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        [shm] = [v for v in template[role]["spec"]["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["sizeLimit"] == "4Gi"


def test_one_gpu_a_node_runs_one_rank_a_pod_and_the_others_elsewhere():
    template = children(spec_of(nodes=3, gpus=1))[("LeaderWorkerSet", "chat-ranks")]["spec"][
        "leaderWorkerTemplate"]
    assert flag(template["leaderTemplate"]["spec"]["containers"][0]["args"], "--tensor-parallel-size") == "3"
    assert template["size"] == 3


def test_what_the_spec_no_longer_wants_is_deleted_only_where_it_can_be():
    several, one = spec_of(), spec_of(nodes=1)
    assert ("apps/v1", "deployments", "chat") in unwanted_children("chat", "ns", several)
    lws_child = (lws.API_VERSION, lws.PLURAL, "chat-ranks")
    assert lws_child in unwanted_children("chat", "ns", one, lws_served=True)
    assert lws_child not in unwanted_children("chat", "ns", one, lws_served=False)
    assert ("apps/v1", "deployments", "chat") not in unwanted_children("chat", "ns", one, lws_served=True)


@pytest.mark.parametrize("spec, size", [
    ({"resources": {"gpus": 4}, "engine": {"nodes": 2}}, 8),
    ({"resources": {"gpus": 1}, "engine": {"nodes": 3}}, 3),
])
def test_the_tensor_parallel_rules_hold_for_every_node_s_gpus(spec, size):
    """Without a KV pool size, M x G ranks are refused as G ranks on one node are."""
    parsed = parse_spec({"model": {"uri": "hf://org/llama"}, **spec})
    refused = refusal(parsed)
    assert refused is not None and refused.reason == "TensorParallelUnsupported"
    assert f"run {size} tensor-parallel ranks" in refused.message


def test_a_tensor_parallel_flag_must_count_every_node_s_gpus():
    refused = refusal(spec_of(2, 4, 1, "--tensor-parallel-size", "4"))
    assert refused is not None and refused.reason == "TensorParallelMismatch"
    assert "resources.gpus x engine.nodes is 8" in refused.message
    assert refusal(spec_of(2, 4, 1, "--tensor-parallel-size", "8")) is None


@pytest.mark.parametrize("flag_name", ["--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless"])
def test_the_ranks_placement_is_the_operators_alone(flag_name):
    given = [flag_name] if flag_name == "--headless" else [flag_name, "1"]
    refused = refusal(spec_of(1, 1, 1, *given))
    assert refused is not None and refused.reason == "TensorParallelMismatch"
    assert flag_name in refused.message and "engine.nodes" in refused.message
    with pytest.raises(ValueError, match="set by the operator itself"):
        server_default_flags(given)  # nor may a platform default


def test_the_bundled_model_splits_over_nodes_times_gpus():
    bundled = {"model": {"uri": "bundled://smollm2-135m-instruct"},
               "engine": {"extraArgs": KV_POOL}}
    three = parse_spec({**bundled, "resources": {"gpus": 1}, "engine": {**bundled["engine"], "nodes": 3}})
    assert OperatorConfig().refusal(three) is None
    two = parse_spec({**bundled, "resources": {"gpus": 1}, "engine": {**bundled["engine"], "nodes": 2}})
    refused = OperatorConfig().refusal(two)
    assert refused is not None and "2 does not divide its 9 attention heads" in refused.message


@pytest.mark.parametrize("spec, message", [
    ({"resources": {"gpus": 0}, "engine": {"nodes": 2}}, "needs resources.gpus >= 1"),
    ({"engine": {"nodes": 0}}, "engine.nodes must be in [1, 16]"),
    ({"engine": {"nodes": 17}}, "engine.nodes must be in [1, 16]"),
])
def test_what_the_crd_refuses_the_spec_refuses_too(spec, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_spec({"model": {"uri": "hf://org/llama"}, **spec})
