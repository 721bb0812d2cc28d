"""Building a model for the engine: its device, dtype, weights and architecture, and the token ids
that end its sequences (finding the files: kvscale.model_files; reading the config: model_config.py)."""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


# model_type in config.json -> how to build its DecoderSpec (module, function); each also has its
# defaults in model_config.FAMILY_DEFAULTS.
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("kvscale.server.worker.model_llama", "spec_from_hf_config"),
    "mistral": ("kvscale.server.worker.model_llama", "spec_from_hf_config"),
    "mixtral": ("kvscale.server.worker.model_moe", "mixtral_spec"),
    "phi3": ("kvscale.server.worker.model_phi3", "phi3_spec"),
    "qwen2": ("kvscale.server.worker.model_qwen", "qwen2_spec"),
    "qwen3": ("kvscale.server.worker.model_qwen", "qwen3_spec"),
    "qwen3_moe": ("kvscale.server.worker.model_moe", "qwen3_moe_spec"),
    "gemma3_text": ("kvscale.server.worker.model_gemma3", "gemma3_spec"),
    "gpt_oss": ("kvscale.server.worker.model_gpt_oss", "gpt_oss_spec"),
}
# model_type -> the model class where the family's layers differ from model_llama's
# DecoderForCausalLM (module, class).
_MODEL_CLASSES: dict[str, tuple[str, str]] = {
    "gemma3_text": ("kvscale.server.worker.model_gemma3", "Gemma3ForCausalLM"),
    "gpt_oss": ("kvscale.server.worker.model_gpt_oss", "GptOssForCausalLM"),
}


def resolve_device(name: str) -> Any:
    """``auto``: CUDA where there is one, else the CPU."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def eos_token_ids(tokenizer: Any, path: Path) -> set[int]:
    """The tokenizer's EOS id and those of the model's generation_config.json."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_config = path / "generation_config.json"
    if gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return ids


def auto_cpu_dtype(native_bf16: bool, onednn_bf16: bool) -> tuple[str, str]:
    """``--dtype auto`` on a CPU: the dtype and why.

    bfloat16 only where the CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX) and oneDNN has
    kernels for it: there W1 runs faster in bf16 than in fp32 (docs/performance.md, "Engine throughput on CPU") and the
    perplexity stays within 1 % of transformers' fp32 (tests/server/worker/test_precision_accuracy.py).
    Elsewhere bf16 is emulated through fp32 and only loses precision.
    """
    if native_bf16 and onednn_bf16:
        return "bfloat16", "the CPU has native bf16 (avx512_bf16/amx_bf16) and oneDNN bf16 kernels"
    if native_bf16:
        return "float32", "the CPU has native bf16 but this torch's oneDNN has no bf16 kernels for it"
    return "float32", "the CPU has no native bf16 (no avx512_bf16 or amx_bf16 flag)"


def resolve_dtype(dtype: str, hf_config: Any, device: Any) -> Any:
    import torch

    names = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16}
    if dtype != "auto":
        return names[dtype]
    if device.type == "cpu":
        from kvscale.server.worker.cpu_features import cpu_features

        onednn_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        chosen, why = auto_cpu_dtype(cpu_features().native_bf16, onednn_bf16)
        logger.info("--dtype auto on %s: %s, because %s", cpu_features().model_name or "this CPU", chosen, why)
        return names[chosen]
    checkpoint = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(checkpoint, str):
        checkpoint = names.get(checkpoint)
    return checkpoint if checkpoint in (torch.float16, torch.bfloat16) else torch.bfloat16


def checkpoint_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its ``model.safetensors.index.json`` names where
    it has one, as transformers reads a sharded checkpoint (other .safetensors beside them, such
    as the consolidated.safetensors of Mistral's repositories, hold the weights again under another
    format's names), else every ``*.safetensors`` in ``path``."""
    index = Path(path) / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        names = sorted(set(weight_map.values()))
        if any(not isinstance(n, str) or Path(n).name != n for n in names):
            raise ValueError(f"{index} names a file outside {path}: only file names in the directory are read")
        missing = [n for n in names if not (Path(path) / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names files that are not in {path}: {missing[:5]}")
        return [Path(path) / n for n in names]
    return sorted(Path(path).glob("*.safetensors"))


def _read_weights(path: Path) -> dict[str, Any]:
    files = checkpoint_files(path)
    weights: dict[str, Any] = {}
    if files:
        from safetensors.torch import load_file

        for file in files:
            weights.update(load_file(str(file)))
        return weights
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {path}")
    import torch

    for file in bins:
        weights.update(torch.load(str(file), map_location="cpu", weights_only=True))
    return weights


def checkpoint_elements(path: Path) -> int | None:
    """How many numbers the checkpoint's tensors hold, from the safetensors headers alone (a few
    KiB read, whatever the size), MXFP4 experts counted as the values they decode to; None for a
    ``.bin`` checkpoint, whose sizes need the load."""
    from kvscale.server.worker.mxfp4 import decoded_numel

    files = checkpoint_files(path)
    if not files:
        return None
    count = 0
    for file in files:
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                numel = 1
                for dim in entry["shape"]:
                    numel *= dim
                count += decoded_numel(name, entry["dtype"], numel)
    return count


# Weights already loaded in this process, keyed by (directory, its config's mtime, dtype, device,
# quantization): engines in one process (tests, benchmarks) share them instead of reading them again.
_LOADED_MODELS: dict[tuple[str, float, str, str, str | None], Any] = {}


def load_model(path: Path, hf_config: Any, dtype: Any, device: Any, quantization: str | None = None,
               *, shared: bool = True) -> Any:
    """Build kvscale's own model for ``hf_config`` and fill it from the checkpoint at ``path``;
    ``shared=False``: a model of its own, never shared (LoRA wraps its projections for one engine:
    server/worker/lora_manager.py)."""
    if not shared:
        return _build_model(path, hf_config, dtype, device, quantization)
    key = (str(Path(path).resolve()), (Path(path) / "config.json").stat().st_mtime, str(dtype), str(device),
           quantization)
    model = _LOADED_MODELS.get(key)
    if model is None:
        model = _build_model(path, hf_config, dtype, device, quantization)
        _LOADED_MODELS[key] = model
    return model


def model_spec(hf_config: Any) -> Any:
    """The DecoderSpec of ``hf_config``'s family; a family kvscale lacks is refused."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _ARCHITECTURES:
        raise ValueError(
            f"model type {model_type!r} is not supported (supported: {', '.join(sorted(_ARCHITECTURES))})"
        )
    module_name, spec_fn = _ARCHITECTURES[model_type]
    return getattr(importlib.import_module(module_name), spec_fn)(hf_config)


def _build_model(path: Path, hf_config: Any, dtype: Any, device: Any, quantization: str | None) -> Any:
    import torch

    from kvscale.server.worker.mxfp4 import is_mxfp4_tensor
    from kvscale.server.worker.quantization import check_quantization

    spec = model_spec(hf_config)
    model_type: str = hf_config.model_type  # model_spec has refused a config without one
    check_quantization(quantization, device.type, mixture_of_experts=spec.moe is not None)
    module_name, class_name = _MODEL_CLASSES.get(model_type, ("kvscale.server.worker.model_llama",
                                                              "DecoderForCausalLM"))
    model_class = getattr(importlib.import_module(module_name), class_name)
    with torch.device("meta"):
        model = model_class(spec, hf_config)
    _materialize(model, dtype, device)
    # MXFP4 blocks and scales stay uint8: the model decodes them layer by layer (mxfp4.py).
    weights = {name: tensor if is_mxfp4_tensor(name) else tensor.to(dtype)
               for name, tensor in _read_weights(path).items()}
    model.load_hf_weights(weights, quantization)
    del weights
    from kvscale.server.worker.memory_profile import malloc_trim

    # The checkpoint's tensors and the copies the load made are freed, but glibc keeps most of
    # them resident; under a pod's memory limit the KV cache allocated next needs that room.
    malloc_trim()
    return model.eval()


def _materialize(model: Any, dtype: Any, device: Any) -> None:
    """Give a model built on the meta device empty storage on ``device``, for the checkpoint to
    fill: ``dtype`` for its parameters and floating-point buffers, as ``Module.to(dtype)`` casts.
    Not ``Module.to_empty``: ``empty_like`` of a meta tensor runs through torch's Python
    references, which import sympy (~1 s of every engine start)."""
    import torch
    from torch import nn

    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device),
                                                         requires_grad=False))
        for name, buffer in list(module.named_buffers(recurse=False)):
            kept = dtype if buffer.is_floating_point() else buffer.dtype
            module.register_buffer(name, torch.empty(buffer.shape, dtype=kept, device=device))
