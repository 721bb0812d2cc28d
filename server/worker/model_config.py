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

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvscale.server.json_object import parse_json_object

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
    "phi3": {"num_key_value_heads": None, "max_position_embeddings": 4096,
             "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
             "sliding_window": None, "hidden_act": "silu"},
    "gemma3_text": {"num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
                    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096, "layer_types": None,
                    "sliding_window_pattern": 6, "final_logit_softcapping": None,
                    "attn_logit_softcapping": None, "use_bidirectional_attention": False,
                    "hidden_activation": "gelu_pytorch_tanh", "rope_theta": 1_000_000.0,
                    "rope_local_base_freq": 10_000.0},
    # transformers' GptOssConfig defaults rope_parameters to this YaRN when a config names none;
    # kept under rope_scaling, which rope.py reads only where rope_parameters is absent, so a
    # config's own rope_parameters or rope_scaling replaces it as in transformers.
    "gpt_oss": {"num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": True,
                "sliding_window": 128, "layer_types": None, "num_local_experts": 128,
                "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                "rope_theta": 150000.0, "quantization_config": None,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096}},
}

# model_type -> transformers' attribute_map for the family: a field config.json may spell either
# way, read under the second name.
FIELD_ALIASES: dict[str, dict[str, str]] = {
    "mixtral": {"num_experts": "num_local_experts"},
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "gpt_oss": {"num_experts": "num_local_experts"},
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
        fields = parse_json_object(file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no config.json in {path}") from None
    except ValueError as exc:
        raise ValueError(f"{file}: {exc}") from None
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
