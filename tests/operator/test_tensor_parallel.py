"""The operator's knowledge of the bundled model's shape, held against the engine's own rule on
the model itself: the sizes the operator refuses are those the engine would refuse at start."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

import pytest
import yaml
from operator_helpers import RefusedSpecKube

from kvscale import model_files
from kvscale.operator import tensor_parallel
from kvscale.operator.config import OperatorConfig
from kvscale.operator.inference_service import ObjectKey
from kvscale.operator.kube import Kube
from kvscale.operator.reconcile import reconcile
from kvscale.operator.runtime import Runtime
from kvscale.operator.spec import parse_spec

CRD = Path(__file__).resolve().parents[2] / "crds" / "inferenceservice.yaml"


def test_the_bundled_models_shape_and_refusals_agree_with_the_engine():
    pytest.importorskip("torch")
    from kvscale.server.worker.model_config import load_model_config
    from kvscale.server.worker.model_loader import model_spec
    from kvscale.server.worker.tp_shard import tensor_parallel_refusal

    config = load_model_config(model_files.resolve_model_path(None))
    spec = model_spec(config)
    assert (spec.num_heads, spec.num_kv_heads, spec.intermediate_size) == (
        tensor_parallel.BUNDLED_NUM_HEADS, tensor_parallel.BUNDLED_NUM_KV_HEADS,
        tensor_parallel.BUNDLED_INTERMEDIATE_SIZE)
    for size in range(1, 17):  # the CRD's resources.gpus range
        engine = tensor_parallel_refusal(size, config.model_type, spec, quantization=None)
        assert (engine is None) == (tensor_parallel.bundled_refusal(size) is None), size


def test_the_platforms_defaults_count_as_the_servers_run_them():
    """A KV pool size the chart's serverDefaultArgs give every server is one the ranks get."""
    spec = parse_spec({"model": {"uri": "hf://org/llama"}, "resources": {"gpus": 2}})
    refused = OperatorConfig().refusal(spec)
    assert refused is not None and refused.reason == "TensorParallelUnsupported"
    assert OperatorConfig(server_defaults=(("--num-gpu-blocks-override", "4096"),)).refusal(spec) is None


def test_a_refused_spec_gets_a_condition_naming_the_heads_and_no_children(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvscale.operator.status.kopf.event", lambda *a, **k: None)
    kube = RefusedSpecKube({"model": {"uri": "bundled://smollm2-135m-instruct"}, "resources": {"gpus": 2},
                           "engine": {"extraArgs": ["--num-gpu-blocks-override", "4096"]}}, generation=3)
    runtime = Runtime(kube=cast(Kube, kube), config=OperatorConfig())
    reconcile(runtime, ObjectKey(uid="u1", namespace="ns", name="chat"), logging.getLogger("test"))
    [(path, body)] = kube.writes
    assert path.endswith("/status")
    [synced] = [c for c in body["status"]["conditions"] if c["type"] == "Synced"]
    assert (synced["status"], synced["reason"]) == ("False", "TensorParallelUnsupported")
    assert "2 does not divide its 9 attention heads" in synced["message"]


def test_the_crds_rule_for_the_bundled_model_holds_the_same_shape():
    """The apiserver refuses at apply what the operator would refuse later: the CEL rule's
    numbers are the operator's."""
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    [rule, over_nodes] = [r for r in schema["x-kubernetes-validations"] if "bundled://" in r["rule"]]
    gpus = "self.spec.resources.gpus"
    # Over several nodes (engine.nodes), every node's GPUs count: the same numbers, of their product.
    ranks = f"({gpus} * self.spec.engine.nodes)"
    assert f"{tensor_parallel.BUNDLED_NUM_HEADS} % {ranks} == 0" in over_nodes["rule"]
    assert f"{tensor_parallel.BUNDLED_INTERMEDIATE_SIZE} % {ranks} == 0" in over_nodes["rule"]
    assert f"its {tensor_parallel.BUNDLED_NUM_HEADS} attention heads" in over_nodes["message"]
    assert f"{tensor_parallel.BUNDLED_NUM_HEADS} % {gpus} == 0" in rule["rule"]
    assert f"{tensor_parallel.BUNDLED_INTERMEDIATE_SIZE} % {gpus} == 0" in rule["rule"]
    assert f"{gpus} <= 1" in rule["rule"]
    assert f"its {tensor_parallel.BUNDLED_NUM_HEADS} attention heads" in rule["message"]
