"""A LoRA adapter read from a PEFT directory (adapter_config.json + adapter_model.safetensors).

Only what the engine applies is accepted (docs/server.md, "LoRA adapters"): plain LoRA (or
rsLoRA's scaling) on the decoder's q/k/v/o and gate/up/down projections; anything else is
refused by name, so an adapter never loads with part of it silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The projections the engine adds LoRA to, by PEFT's (transformers') module names.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_WEIGHT_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float  # lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), folded into B on load
    # (layer index, module name) -> (A [r, in], B [out, r]) as the file holds them.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _config_refusal(config: dict[str, Any], max_rank: int) -> str | None:
    """Why the engine cannot apply an adapter of this adapter_config.json; None where it can."""
    if config.get("peft_type", "LORA") != "LORA":
        return f"peft_type {config.get('peft_type')!r} is not LoRA"
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        return f"r must be a positive integer, got {rank!r}"
    if rank > max_rank:
        return f"its rank {rank} is above --max-lora-rank {max_rank}"
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag):
            return f"{flag} is not supported"
    if config.get("modules_to_save"):
        return "modules_to_save (fully trained extra modules) is not supported"
    if config.get("bias", "none") != "none":
        return f"bias {config.get('bias')!r} is not supported (only 'none')"
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            return f"{key} (per-module ranks or alphas) is not supported"
    if config.get("layers_to_transform") is not None:
        return "layers_to_transform is not supported"
    targets = config.get("target_modules")
    if targets == "all-linear":
        return None
    if not isinstance(targets, list) or not targets:
        return f"target_modules {targets!r} is not supported (a list of module names, or 'all-linear')"
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        return f"target_modules {unknown} are not supported (supported: {', '.join(TARGET_MODULES)})"
    return None


def load_lora_adapter(name: str, path: str, max_rank: int) -> LoRAAdapter:
    """The adapter at ``path`` (a PEFT save_pretrained directory), or ValueError saying why not."""
    folder = Path(path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {path} must hold adapter_config.json and "
                         "adapter_model.safetensors (PEFT's save_pretrained)")
    config = json.loads(config_file.read_text())
    why = _config_refusal(config, max_rank)
    if why is not None:
        raise ValueError(f"LoRA adapter {name!r} ({path}): {why}")
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    from safetensors.torch import load_file

    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        match = _WEIGHT_NAME.match(key)
        if match is None or match.group(2) not in TARGET_MODULES:
            raise ValueError(f"LoRA adapter {name!r}: weight {key!r} is not a LoRA A/B of a supported projection")
        halves.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for where, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {where[0]} {where[1]} lacks lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"LoRA adapter {name!r}: layer {where[0]} {where[1]}'s A/B are not of rank {rank}")
        weights[where] = (a, b)
    return LoRAAdapter(name, path, rank, scaling, weights)
