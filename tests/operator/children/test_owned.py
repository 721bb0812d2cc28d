"""The children of one InferenceService: the servers run the operator's engine image unless the
spec names one (the chart's images.engine reaches the operator as --engine-image)."""

from __future__ import annotations

from typing import Any

from kvscale.operator.children.owned import Images, build_children
from kvscale.operator.spec import DEFAULT_IMAGE, parse_spec

OURS = Images(engine="registry.example/kvscale/kvscale:dev")


def server_images(children: list[dict[str, Any]]) -> set[str]:
    """Every image the servers' pod runs (its hf:// init container included)."""
    (servers,) = [c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "m"]
    pod = servers["spec"]["template"]["spec"]
    return {c["image"] for c in [*pod.get("initContainers", []), *pod["containers"]]}


def test_a_spec_without_an_image_gets_the_operators_engine_image():
    spec = parse_spec({"model": {"uri": "hf://org/tiny"}})
    assert server_images(build_children("m", "ns", spec, OURS)) == {OURS.engine}
    # Without a configured one, the operator's built-in default.
    assert server_images(build_children("m", "ns", spec)) == {DEFAULT_IMAGE}


def test_a_spec_naming_an_image_keeps_it():
    spec = parse_spec({"model": {"uri": "hf://org/tiny"}, "image": "mine/kvscale:1"})
    assert server_images(build_children("m", "ns", spec, OURS)) == {"mine/kvscale:1"}
