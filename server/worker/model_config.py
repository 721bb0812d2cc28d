"""A checkpoint's ``config.json`` as the engine reads it, without importing transformers.

transformers' config classes pull in its kernel hub, ``torch._dynamo`` and
``torch.distributed.tensor`` when imported: about 5 s of CPU at every engine start, more than the
weights take to load, paid again by every replica a scale-out or a scale from zero starts. The
engine reads a dozen fields, so it reads them here, over the defaults transformers' class for the
family gives them (tests/server/worker/test_model_config.py keeps the two equal for every family
the engine serves). A RoPE variant other than the default is still computed by transformers,
from the config transformers builds (``ModelConfig.transformers_config``).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Fields a config.json must name: transformers would default them to a 7B model's shapes, which
# no checkpoint missing them has.
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

# model_type -> what transformers' config class of the family defaults the optional fields the
# engine reads to (its class attributes and __post_init__).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
              "mlp_bias": False},
    "mistral": {"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 4096 * 32,
                "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "sliding_window": 4096},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
              "use_sliding_window": False, "sliding_window": 4096},
    "mixtral": {"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 4096 * 32,
                "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None,
                "rope_theta": 1e6, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                  "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
                  "sliding_window": 4096, "num_local_experts": 128, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768, "norm_topk_prob": False, "decoder_sparse_step": 1,
                  "mlp_only_layers": None},
}

# model_type -> transformers' attribute_map for the family: a field config.json may spell either
# way, read under the second name.
FIELD_ALIASES: dict[str, dict[str, str]] = {
    "mixtral": {"num_experts": "num_local_experts"},
    "qwen3_moe": {"num_experts": "num_local_experts"},
}


class ModelConfig(SimpleNamespace):
    """config.json's fields as attributes, the family's defaults under them."""

    def transformers_config(self) -> Any:
        """The same file through transformers, for what only transformers computes."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.name_or_path)


def load_model_config(path: str | Path) -> ModelConfig:
    """The config of the checkpoint in directory ``path``; an unsupported family or a config
    missing a shape is refused here, before anything is allocated."""
    file = Path(path) / "config.json"
    try:
        fields = json.loads(file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no config.json in {path}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{file} holds no JSON object")
    model_type = fields.get("model_type")
    if model_type not in FAMILY_DEFAULTS:
        raise ValueError(
            f"model type {model_type!r} is not supported (supported: {', '.join(sorted(FAMILY_DEFAULTS))})"
        )
    for alias, name in FIELD_ALIASES.get(model_type, {}).items():
        if alias in fields:
            value = fields.pop(alias)
            if fields.setdefault(name, value) != value:
                # transformers keeps one or the other depending on the family: neither is safe to guess.
                raise ValueError(f"{file} names both {alias} ({value}) and {name} ({fields[name]})")
    missing = [name for name in REQUIRED_FIELDS if not isinstance(fields.get(name), int)]
    if missing:
        raise ValueError(f"{file} names no integer {', '.join(missing)}")
    return ModelConfig(**{**FAMILY_DEFAULTS[model_type], **fields, "name_or_path": str(path)})
