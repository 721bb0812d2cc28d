"""LoRA adapters made with PEFT on a checkpoint, for the LoRA tests and bench.lora: nothing is
downloaded, every adapter is PEFT's own ``save_pretrained`` directory (what ``--lora-modules``
reads), and its B matrices are random and of a visible size (PEFT's own random B is small next to
the base weights, so an adapter would barely change a token)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# PEFT's module names for every projection the engine adds LoRA to (server/worker/lora_adapter.py).
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_adapters(base_model: Any, adapters: Mapping[str, Mapping[str, Any]], root: Path,
                  b_std: float = 0.3) -> Iterator[tuple[str, str, Any]]:
    """Each adapter of ``adapters`` (name -> ``LoraConfig`` fields), the i-th from seed i, made by
    PEFT on ``base_model`` (a transformers model, changed in place while an adapter is on it) with
    B drawn from N(0, ``b_std``), saved under ``root``/name. Yields (name, path, the PEFT model)
    while that adapter is on the base model (to compute its reference outputs), then takes it off
    again: one base model serves every adapter, none is reloaded."""
    import torch
    from peft import LoraConfig, get_peft_model

    for seed, (name, settings) in enumerate(adapters.items()):
        torch.manual_seed(seed)
        peft_model = get_peft_model(base_model, LoraConfig(init_lora_weights=False, **settings))
        with torch.no_grad():
            for param_name, param in peft_model.named_parameters():
                if "lora_B" in param_name:
                    param.normal_(0, b_std)
        path = root / name
        peft_model.save_pretrained(str(path))
        yield name, str(path), peft_model
        base_model = peft_model.unload()
