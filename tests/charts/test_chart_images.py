"""The chart's images reach what runs: images.engine becomes the operator's default engine image
(--engine-image), so an InferenceService without spec.image runs it; by default every image is
the one `make image` builds (tools/images.sh names them)."""

from __future__ import annotations

import argparse
import subprocess
from typing import Any

from chart_helpers import REPO_ROOT, Helm

from kvscale.operator import cli_operator
from kvscale.operator.children.owned import build_children
from kvscale.operator.config import config_from_args
from kvscale.operator.spec import parse_spec


def operator_container(helm: Helm, *values: str) -> dict[str, Any]:
    (deployment,) = [o for o in helm.template(*values, show_only=["templates/operator.yaml"])
                     if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def operator_config(container: dict[str, Any]):
    """The OperatorConfig `kvscale operator` makes of the container's arguments."""
    parser = argparse.ArgumentParser()
    cli_operator.add_arguments(parser)
    assert container["args"][0] == "operator"
    return config_from_args(parser.parse_args(container["args"][1:]))


def test_images_engine_is_the_engine_image_the_operator_runs(helm):
    container = operator_container(helm, "images.engine.repository=registry.example/ml/kvscale",
                                   "images.engine.tag=2024.1")
    assert "--engine-image=registry.example/ml/kvscale:2024.1" in container["args"]
    config = operator_config(container)
    spec = parse_spec({"model": {"uri": "bundled://smollm2-135m-instruct"}})
    (servers,) = [c for c in build_children("chat", "team", spec, config.images)
                  if c["kind"] == "Deployment" and c["metadata"]["name"] == "chat"]
    assert servers["spec"]["template"]["spec"]["containers"][0]["image"] == \
        "registry.example/ml/kvscale:2024.1"


def test_default_images_are_the_ones_make_image_builds(helm):
    built = {which: subprocess.run(["bash", str(REPO_ROOT / "tools" / "images.sh"), "name", which],
                                   capture_output=True, text=True, check=True).stdout.strip()
             for which in ("engine", "control-plane")}
    container = operator_container(helm)
    config = operator_config(container)
    assert container["image"] == built["control-plane"]
    assert (config.images.engine, config.images.router) == (built["engine"], built["control-plane"])


def test_the_allow_lists_reach_the_operator(helm):
    """operator.allowedImages (besides images.*) and operator.allowedApiKeySecrets become the
    operator's allow-lists; "*" lifts a list (docs/operator.md, "What an InferenceService may
    choose")."""
    config = operator_config(operator_container(helm))
    assert set(config.allow.images) == {"ghcr.io/kvscale/kvscale", "ghcr.io/kvscale/kvscale-control-plane",
                                        "docker.io/library/redis"}
    assert config.allow.api_key_secrets == ()  # ["*"]: any Secret
    spec = parse_spec({"model": {"uri": "bundled://smollm2-135m-instruct"}, "image": "quay.io/team/engine:1"})
    refused = config.allow.refusal(spec)
    assert refused is not None and refused.reason == "ImageNotAllowed"
    listed = operator_config(operator_container(helm, "operator.allowedImages={quay.io/team/engine}",
                                                "operator.allowedApiKeySecrets={*-api-key}"))
    assert listed.allow.refusal(spec) is None and listed.allow.api_key_secrets == ("*-api-key",)
    anything = operator_config(operator_container(helm, "operator.allowedImages={*}"))
    assert anything.allow.images == ()
