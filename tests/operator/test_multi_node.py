"""Whether a replica over several nodes can be built: LWS discovery, remembered briefly, and the
decisions made from it (operator/multi_node.py; docs/operator.md, "A replica over several nodes")."""

from __future__ import annotations

import logging
from typing import Any, cast

import pytest
from operator_helpers import RefusedSpecKube

from kvscale.operator import multi_node
from kvscale.operator.config import OperatorConfig
from kvscale.operator.inference_service import ObjectKey
from kvscale.operator.kube import Kube
from kvscale.operator.reconcile import reconcile
from kvscale.operator.runtime import Runtime
from kvscale.operator.spec import parse_spec

SEVERAL = {"model": {"uri": "hf://org/llama"}, "resources": {"gpus": 2},
           "engine": {"nodes": 2, "extraArgs": ["--num-gpu-blocks-override", "4096"]}}
LWS_GROUP = {"kind": "APIResourceList", "groupVersion": "leaderworkerset.x-k8s.io/v1",
             "resources": [{"name": "leaderworkersets", "namespaced": True, "kind": "LeaderWorkerSet"},
                           {"name": "leaderworkersets/scale", "namespaced": True, "kind": "Scale"}]}


class DiscoveryKube:
    """Answers the discovery of leaderworkerset.x-k8s.io/v1 as the API server does (404 without
    the CRD), counting the questions."""

    def __init__(self, installed: bool) -> None:
        self.installed = installed
        self.asked = 0

    def get(self, path: str) -> dict[str, Any] | None:
        assert path == "/apis/leaderworkerset.x-k8s.io/v1", path
        self.asked += 1
        return LWS_GROUP if self.installed else None


def test_the_kind_is_served_only_with_its_resource_listed():
    assert multi_node.kind_served(cast(Kube, DiscoveryKube(True)))
    assert not multi_node.kind_served(cast(Kube, DiscoveryKube(False)))


@pytest.mark.parametrize("asked_at, now, fresh", [
    (None, 5.0, False), (100.0, 100.0, True), (100.0, 109.9, True), (100.0, 110.0, False),
    (100.0, 99.0, False),  # a clock that went back: ask again
])
def test_an_answer_stands_for_the_ttl(asked_at, now, fresh):
    assert multi_node.still_fresh(asked_at, now, 10.0) is fresh


def test_discovery_is_asked_once_per_ttl_and_sees_a_crd_installed_later():
    kube = DiscoveryKube(False)
    discovery = multi_node.LeaderWorkerSetDiscovery(ttl_s=10.0)
    assert not discovery.served(cast(Kube, kube), now=0.0)
    kube.installed = True
    assert not discovery.served(cast(Kube, kube), now=9.0)  # remembered
    assert kube.asked == 1
    assert discovery.served(cast(Kube, kube), now=10.5)  # asked again
    assert kube.asked == 2


def test_only_several_nodes_without_the_kind_are_refused():
    several, one = parse_spec(SEVERAL), parse_spec({"model": {"uri": "hf://org/llama"}})
    refused = multi_node.refusal(several, served=False)
    assert refused is not None
    assert (refused.type, refused.status, refused.reason) == ("Synced", False, "LeaderWorkerSetUnavailable")
    assert "leaderworkersets.leaderworkerset.x-k8s.io" in refused.message
    assert "install LeaderWorkerSet" in refused.message
    assert multi_node.refusal(several, served=True) is None
    assert multi_node.refusal(one, served=False) is None


def test_discovery_is_asked_only_for_what_can_use_it():
    several, one = parse_spec(SEVERAL), parse_spec({"model": {"uri": "hf://org/llama"}})
    assert multi_node.asks_discovery(several, {})
    assert not multi_node.asks_discovery(one, {})
    # Back to one node after several: the LeaderWorkerSet left behind is looked for.
    assert multi_node.asks_discovery(one, {"tensorParallelSecret": "chat-tp-authkey"})


def test_a_leader_worker_sets_counts_read_as_a_deployments():
    assert multi_node.as_rollout(None) is None
    rollout = multi_node.as_rollout({"metadata": {"generation": 4},
                                     "status": {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2}})
    assert rollout is not None
    assert rollout["status"] == {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2,
                                 "observedGeneration": 4}


def test_without_the_kind_the_condition_says_why_and_nothing_is_made(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("kvscale.operator.status.kopf.event", lambda *a, **k: None)
    kube = RefusedSpecKube(SEVERAL, generation=3)  # discovery: 404, as without the CRD
    runtime = Runtime(kube=cast(Kube, kube), config=OperatorConfig())
    reconcile(runtime, ObjectKey(uid="u1", namespace="ns", name="chat"), logging.getLogger("test"))
    [(path, body)] = kube.writes  # the status alone: no child, no Secret
    assert path.endswith("/status")
    [synced] = [c for c in body["status"]["conditions"] if c["type"] == "Synced"]
    assert (synced["status"], synced["reason"]) == ("False", "LeaderWorkerSetUnavailable")
