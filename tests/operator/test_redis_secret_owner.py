"""A `NAME-redis` Secret the operator did not make is refused: the operator may not read
Secrets, so it records the one it made (status.redisSecret) and runs no Redis under a password
someone else chose."""

from __future__ import annotations

from typing import Any, cast

from kvscale.operator.apply import apply_children
from kvscale.operator.children.owned import Images
from kvscale.operator.inference_service import as_body
from kvscale.operator.kube import ApiError, Kube
from kvscale.operator.spec import parse_spec

UID = "uid-1"


class FakeKube:
    """Records what the operator does; `secrets` exist already (a create is a 409)."""

    def __init__(self, secrets: set[str], existing: dict[str, dict[str, Any]] | None = None):
        self.secrets = secrets
        self.existing = existing or {}
        self.applied: list[str] = []
        self.status_patches: list[dict[str, Any]] = []

    def create_if_absent(self, path: str, body: dict[str, Any]) -> bool:
        if body["metadata"]["name"] in self.secrets:
            return False
        self.secrets.add(body["metadata"]["name"])
        return True

    def get(self, path: str) -> dict[str, Any] | None:
        return self.existing.get(path)

    def apply(self, path: str, body: dict[str, Any], field_manager: str) -> dict[str, Any]:
        self.applied.append(f"{body['kind']}/{body['metadata']['name']}")
        return body

    def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert path.endswith("/status")
        self.status_patches.append(body)
        return body

    def delete(self, path: str) -> bool:
        raise ApiError(500, "", "not expected")


def owner(status: dict[str, Any] | None = None) -> Any:
    return as_body({"apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
                    "metadata": {"name": "chat", "namespace": "ns", "uid": UID},
                    "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"}},
                    "status": status or {}})


SPEC = parse_spec({"model": {"uri": "bundled://smollm2-135m-instruct"}})


def test_a_redis_secret_someone_else_made_is_refused_and_no_redis_runs() -> None:
    kube = FakeKube({"chat-redis"})
    conflicts = apply_children(cast(Kube, kube), owner(), SPEC, Images())
    assert len(conflicts) == 1 and "Secret chat-redis already exists" in conflicts[0]
    assert "Deployment/chat-redis" not in kube.applied and "Service/chat-redis" not in kube.applied
    assert "Deployment/chat" in kube.applied  # the rest is applied
    assert kube.status_patches == []


def test_the_secret_the_operator_made_is_recorded_and_kept() -> None:
    kube = FakeKube(set())
    assert apply_children(cast(Kube, kube), owner(), SPEC, Images()) == []
    assert kube.status_patches == [{"status": {"redisSecret": "chat-redis"}}]
    assert "Deployment/chat-redis" in kube.applied
    # Next reconcile: it exists (409) and is recorded as ours.
    again = FakeKube({"chat-redis"})
    assert apply_children(cast(Kube, again), owner({"redisSecret": "chat-redis"}), SPEC, Images()) == []
    assert "Deployment/chat-redis" in again.applied


def test_one_an_older_operator_made_is_known_by_the_redis_it_runs() -> None:
    redis = {"metadata": {"name": "chat-redis",
                          "ownerReferences": [{"uid": UID, "controller": True}]}}
    kube = FakeKube({"chat-redis"}, {"/apis/apps/v1/namespaces/ns/deployments/chat-redis": redis})
    assert apply_children(cast(Kube, kube), owner(), SPEC, Images()) == []
    assert kube.status_patches == [{"status": {"redisSecret": "chat-redis"}}]
