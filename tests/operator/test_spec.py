"""The typed spec: bad values refused, defaults equal to the CRD's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvscale.operator.spec import (
    AutoscalingPolicy,
    EngineConfig,
    Resources,
    RouterSpec,
    parse_spec,
)
from kvscale.router.policy import POLICIES

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "inferenceservice.yaml"
BUNDLED = {"model": {"uri": "bundled://smollm2-135m-instruct"}}


@pytest.mark.parametrize("uri", ["s3://bucket/model", "hf:/org", "", "pvc://"])
def test_bad_model_uri_is_rejected(uri):
    with pytest.raises(ValueError, match="model.uri"):
        parse_spec({"model": {"uri": uri}})


def _crd_spec_schema() -> dict:
    crd = yaml.safe_load(CRD_PATH.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


def test_python_defaults_match_the_crd_defaults():
    schema = _crd_spec_schema()

    def defaults(section: str) -> dict:
        return {k: v["default"] for k, v in schema[section]["properties"].items() if "default" in v}

    engine, resources, autoscaling = EngineConfig(), Resources(), AutoscalingPolicy()
    assert defaults("engine") == {
        "blockSize": engine.block_size, "maxNumSeqs": engine.max_num_seqs, "dtype": engine.dtype,
        "gpuMemoryUtilization": engine.gpu_memory_utilization,
        "enablePrefixCaching": engine.enable_prefix_caching, "nodes": engine.nodes}
    assert defaults("resources") == {"gpus": resources.gpus, "cpu": resources.cpu,
                                     "memory": resources.memory}
    assert defaults("autoscaling") == {
        "enabled": autoscaling.enabled, "minReplicas": autoscaling.min_replicas,
        "maxReplicas": autoscaling.max_replicas, "targetKVUsage": autoscaling.target_kv_usage,
        "targetQueueLength": autoscaling.target_queue_length,
        "targetPrefillSeconds": autoscaling.target_prefill_seconds,
        "scaleUpStabilizationSeconds": autoscaling.scale_up_stabilization_seconds,
        "scaleDownStabilizationSeconds": autoscaling.scale_down_stabilization_seconds,
        "panicWindowSeconds": autoscaling.panic_window_seconds,
        "panicThreshold": autoscaling.panic_threshold,
        "maxScaleUpRate": autoscaling.max_scale_up_rate,
        "scaleToZeroAfterSeconds": autoscaling.scale_to_zero_after_seconds,
        "activationTimeoutSeconds": autoscaling.activation_timeout_seconds}
    # No default image: absent, it is the operator's --engine-image (Images.engine), which an
    # apiserver-filled default would shadow.
    assert "default" not in schema["image"] and parse_spec({"model": {"uri": "hf://a/b"}}).image == ""
    assert schema["replicas"]["default"] == 1


def test_router_spec_defaults_and_bad_combinations():
    assert parse_spec(BUNDLED).router == RouterSpec()
    with pytest.raises(ValueError, match="url or secretRef"):
        parse_spec({**BUNDLED, "router": {"redis": {"url": "redis://r:6379", "secretRef": {"name": "s"}}}})
    with pytest.raises(ValueError, match="redis://"):
        parse_spec({**BUNDLED, "router": {"redis": {"url": "http://r:6379"}}})


def test_crd_router_schema_matches_the_router():
    schema = yaml.safe_load(CRD_PATH.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    router = schema["properties"]["spec"]["properties"]["router"]["properties"]
    assert set(router["policy"]["enum"]) == set(POLICIES)
    defaults = RouterSpec()
    assert router["enabled"]["default"] is defaults.enabled
    assert router["replicas"]["default"] == defaults.replicas
    assert router["resources"]["properties"]["cpu"]["default"] == defaults.resources.cpu
    assert router["resources"]["properties"]["memory"]["default"] == defaults.resources.memory
    assert router["redis"]["properties"]["secretRef"]["properties"]["key"]["default"] == "url"


def test_min_replicas_zero_needs_the_router():
    spec = parse_spec({**BUNDLED, "autoscaling": {"enabled": True, "minReplicas": 0,
                                                  "scaleToZeroAfterSeconds": 30}})
    assert spec.autoscaling.scales_to_zero and spec.autoscaling.scale_to_zero_after_seconds == 30
    assert not parse_spec({**BUNDLED, "autoscaling": {"minReplicas": 0}}).autoscaling.scales_to_zero
    with pytest.raises(ValueError, match="needs the router"):
        parse_spec({**BUNDLED, "autoscaling": {"enabled": True, "minReplicas": 0},
                    "router": {"enabled": False}})


@pytest.mark.parametrize(("extra_args", "flag", "sets"), [
    (["--max-tools", "8"], "--max-tools", True),
    (["--max-tools=8"], "--max-tools", True),
    (["--no-async-scheduling"], "--async-scheduling", True),
    (["--async-scheduling"], "--no-async-scheduling", True),
    (["--max-tools-x=8"], "--max-tools", False),
    (["--tool-call-parser", "--max-tools"], "--max-tools", True),
    (["--tool-call-parser", "hermes"], "--hermes", False),
])
def test_extra_args_set_a_flag_as_itself_or_negated(extra_args, flag, sets):
    spec = parse_spec({"model": {"uri": "bundled://smollm2-135m-instruct"}, "engine": {"extraArgs": extra_args}})
    assert spec.engine.sets(flag) is sets
