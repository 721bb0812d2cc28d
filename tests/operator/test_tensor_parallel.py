"""The operator's knowledge of the bundled model's shape, held against the engine's own rule on
the model itself: the sizes the operator refuses are those the engine would refuse at start."""

from __future__ import annotations

import pytest

from kvscale import model_files
from kvscale.operator import tensor_parallel


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
        engine = tensor_parallel_refusal(size, config.model_type, spec, quantization=None,
                                         kv_offloading_size=0.0)
        assert (engine is None) == (tensor_parallel.bundled_refusal(size) is None), size


def test_the_platforms_defaults_count_as_the_servers_run_them():
    """A KV pool size the chart's serverDefaultArgs give every server is one the ranks get."""
    from kvscale.operator.config import OperatorConfig
    from kvscale.operator.spec import parse_spec

    spec = parse_spec({"model": {"uri": "hf://org/llama"}, "resources": {"gpus": 2}})
    refused = OperatorConfig().refusal(spec)
    assert refused is not None and refused.reason == "TensorParallelUnsupported"
    assert OperatorConfig(server_defaults=(("--num-gpu-blocks-override", "4096"),)).refusal(spec) is None
