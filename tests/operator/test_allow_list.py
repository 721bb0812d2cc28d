"""What an InferenceService may choose: images from the allowed repositories, API-key Secrets
by name pattern; a refused spec gets Synced=False with why and no children."""

from __future__ import annotations

import argparse
import logging
from typing import cast

import pytest
from operator_helpers import RefusedSpecKube

from kvscale.operator import cli_operator
from kvscale.operator.allow_list import AllowList, image_in, repository_of
from kvscale.operator.config import OperatorConfig, config_from_args
from kvscale.operator.inference_service import ObjectKey
from kvscale.operator.kube import Kube
from kvscale.operator.reconcile import reconcile
from kvscale.operator.runtime import Runtime
from kvscale.operator.spec import parse_spec

MODEL = {"uri": "bundled://smollm2-135m-instruct"}


def test_an_image_is_allowed_by_repository_not_by_prefix() -> None:
    repos = ("ghcr.io/kvscale/kvscale", "registry.local:5000/team/engine")
    assert image_in("ghcr.io/kvscale/kvscale:0.1.0", repos)
    assert image_in("ghcr.io/kvscale/kvscale@sha256:" + "0" * 64, repos)
    assert image_in("registry.local:5000/team/engine:v2", repos)
    assert not image_in("ghcr.io/kvscale/kvscale-evil:0.1.0", repos)
    assert not image_in("docker.io/attacker/miner:latest", repos)
    assert repository_of("registry.local:5000/team/engine:v2") == "registry.local:5000/team/engine"
    assert repository_of("registry.local:5000/team/engine") == "registry.local:5000/team/engine"
    assert repository_of("redis@sha256:abc") == "redis"


def test_the_spec_is_refused_with_a_condition_naming_what() -> None:
    allow = AllowList(("ghcr.io/kvscale/kvscale",), ("*-api-key",))
    assert allow.refusal(parse_spec({"model": MODEL})) is None  # the operator's own engine image
    mined = allow.refusal(parse_spec({"model": MODEL, "image": "docker.io/attacker/miner:1"}))
    assert mined is not None and (mined.type, mined.status, mined.reason) == ("Synced", False, "ImageNotAllowed")
    assert "docker.io/attacker/miner:1" in mined.message
    stolen = allow.refusal(parse_spec({"model": MODEL, "apiKeySecretRef": {"name": "database-password"}}))
    assert stolen is not None and stolen.reason == "SecretNotAllowed" and "database-password" in stolen.message
    assert allow.refusal(parse_spec({"model": MODEL, "apiKeySecretRef": {"name": "chat-api-key"}})) is None
    assert AllowList().refusal(parse_spec({"model": MODEL, "image": "anything:1",
                                           "apiKeySecretRef": {"name": "any"}})) is None


def test_the_flags_add_the_operators_own_images() -> None:
    parser = argparse.ArgumentParser()
    cli_operator.add_arguments(parser)
    config = config_from_args(parser.parse_args(["--allowed-image", "registry.local/team/engine",
                                                 "--allowed-api-key-secret", "*-key"]))
    assert config.allow.images[0] == "registry.local/team/engine"
    assert {"ghcr.io/kvscale/kvscale", "ghcr.io/kvscale/kvscale-control-plane",
            "docker.io/library/redis"} <= set(config.allow.images)
    assert config.allow.api_key_secrets == ("*-key",)
    assert config_from_args(parser.parse_args([])).allow == AllowList()  # no flag: anything


def test_a_refused_spec_gets_no_children(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvscale.operator.status.kopf.event", lambda *a, **k: None)
    kube = RefusedSpecKube({"model": MODEL, "image": "docker.io/attacker/miner:1"})
    runtime = Runtime(kube=cast(Kube, kube), config=OperatorConfig(
        allow=AllowList(("ghcr.io/kvscale/kvscale",))))
    reconcile(runtime, ObjectKey(uid="u1", namespace="ns", name="chat"), logging.getLogger("test"))
    [(path, body)] = kube.writes
    assert path.endswith("/status")
    [synced] = [c for c in body["status"]["conditions"] if c["type"] == "Synced"]
    assert (synced["status"], synced["reason"]) == ("False", "ImageNotAllowed")
