"""A server Deployment with several GPUs per replica: --tensor-parallel-size and /dev/shm, from
the spec alone (docs/operator.md, "Several GPUs per replica")."""

from __future__ import annotations

from typing import Any

import pytest

from kvscale.operator.children.servers import build_deployment
from kvscale.operator.spec import parse_spec
from kvscale.operator.tensor_parallel import refusal

# Tensor parallel on GPUs needs its KV pool's size given (docs/engine.md, "Tensor parallel").
KV_POOL = "--kv-cache-memory-bytes=8000000000"


def deployment(gpus: int, *extra_args: str, uri: str = "hf://org/llama") -> dict[str, Any]:
    return build_deployment("llama", "team-a", parse_spec({
        "model": {"uri": uri}, "resources": {"gpus": gpus},
        "engine": {"extraArgs": list(extra_args)}}))


def args_of(obj: dict[str, Any]) -> list[str]:
    return list(obj["spec"]["template"]["spec"]["containers"][0]["args"])


def shm_of(obj: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = obj["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "dshm")
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "dshm")
    return volume, mount


@pytest.mark.parametrize("gpus", [0, 1])
def test_one_gpu_or_none_runs_one_rank(gpus):
    obj = deployment(gpus)
    assert "--tensor-parallel-size" not in args_of(obj)
    volume, mount = shm_of(obj)
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert mount["mountPath"] == "/dev/shm"


def test_two_gpus_run_two_ranks_with_shared_memory_for_each():
    obj = deployment(2)
    args = args_of(obj)
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args.count("--tensor-parallel-size") == 1
    volume, mount = shm_of(obj)
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert mount["mountPath"] == "/dev/shm"
    resources = obj["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 2


@pytest.mark.parametrize("flag", [["--tensor-parallel-size", "4"], ["--tensor-parallel-size=4"],
                                  ["-tp", "4"]])
def test_the_users_own_flag_equal_to_the_gpus_is_passed_once(flag):
    obj = deployment(4, *flag)
    args = args_of(obj)
    assert args[-len(flag):] == flag  # the user's, where extraArgs go
    assert sum(a.split("=")[0] in ("--tensor-parallel-size", "-tp") for a in args) == 1
    assert shm_of(obj)[0]["emptyDir"]["sizeLimit"] == "4Gi"
    spec = parse_spec({"model": {"uri": "hf://org/llama"}, "resources": {"gpus": 4},
                       "engine": {"extraArgs": [*flag, KV_POOL]}})
    assert refusal(spec) is None


@pytest.mark.parametrize(("gpus", "flag"), [
    (2, ["--tensor-parallel-size", "4"]), (4, ["--tensor-parallel-size=2"]), (1, ["-tp", "2"]),
    (2, ["--tensor-parallel-size", "2", "--tensor-parallel-size", "1"]),  # argparse: the last wins
])
def test_the_users_flag_differing_from_the_gpus_is_refused(gpus, flag):
    spec = parse_spec({"model": {"uri": "hf://org/llama"}, "resources": {"gpus": gpus},
                       "engine": {"extraArgs": flag}})
    refused = refusal(spec)
    assert refused is not None and refused.type == "Synced" and refused.status is False
    assert refused.reason == "TensorParallelMismatch"
    assert f"resources.gpus is {gpus}" in refused.message and "nothing is applied" in refused.message


def test_a_cpu_server_takes_its_ranks_from_the_flag():
    spec = parse_spec({"model": {"uri": "hf://org/llama"}, "resources": {"gpus": 0},
                       "engine": {"extraArgs": ["--tensor-parallel-size", "2"]}})
    assert refusal(spec) is None
    assert shm_of(build_deployment("llama", "team-a", spec))[0]["emptyDir"]["sizeLimit"] == "2Gi"
    bad = parse_spec({"model": {"uri": "hf://org/llama"}, "resources": {"gpus": 0},
                      "engine": {"extraArgs": ["-tp", "two"]}})
    assert refusal(bad) is not None and refusal(bad).reason == "TensorParallelMismatch"  # type: ignore[union-attr]


@pytest.mark.parametrize(("gpus", "extra"), [(2, []), (0, ["-tp", "2"]), (9, [])])
def test_the_bundled_model_on_ranks_its_shape_does_not_split_into_is_refused(gpus, extra):
    spec = parse_spec({"model": {"uri": "bundled://smollm2-135m-instruct"}, "resources": {"gpus": gpus},
                       "engine": {"extraArgs": extra}})
    refused = refusal(spec)
    assert refused is not None and refused.reason == "TensorParallelUnsupported"
    size = gpus or 2
    assert "bundled://smollm2-135m-instruct" in refused.message
    assert f"cannot run on {size} tensor-parallel ranks" in refused.message
    if size == 2:
        assert "9 attention heads" in refused.message


def test_the_bundled_model_on_three_gpus_is_served():
    spec = parse_spec({"model": {"uri": "bundled://smollm2-135m-instruct"}, "resources": {"gpus": 3},
                       "engine": {"extraArgs": ["--num-gpu-blocks-override", "4096"]}})
    assert refusal(spec) is None
    args = args_of(build_deployment("chat", "default", spec))
    assert args[args.index("--tensor-parallel-size") + 1] == "3"


def test_gpu_ranks_without_their_kv_pools_size_are_refused():
    spec = parse_spec({"model": {"uri": "hf://org/llama"}, "resources": {"gpus": 2}})
    refused = refusal(spec)
    assert refused is not None and refused.reason == "TensorParallelUnsupported"
    assert "--kv-cache-memory-bytes or --num-gpu-blocks-override" in refused.message
