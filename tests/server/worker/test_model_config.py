"""The engine's own reading of config.json against transformers' config classes: for every family
it serves, the decoder shape (its experts and their routing included) and the RoPE tables it
builds are transformers' own, from a config naming only the shapes (every default in play) and
from complete ones."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

from kvscale.server.worker.model_config import FAMILY_DEFAULTS, FIELD_ALIASES, load_model_config
from kvscale.server.worker.model_llama import DecoderSpec, rope_inv_freq, spec_from_hf_config
from kvscale.server.worker.model_loader import _ARCHITECTURES

SHAPES = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4}

# Fields set away from their defaults, one variant each, on top of SHAPES.
VARIANTS: list[dict] = [
    {},
    {"num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 777, "rms_norm_eps": 1e-5,
     "tie_word_embeddings": True},
    {"attention_bias": True, "mlp_bias": True},
    {"sliding_window": 96, "use_sliding_window": True},
    {"use_sliding_window": True},  # the window: the family's default
    {"sliding_window": None},
    {"rope_theta": 500000.0},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 20000.0},
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    {"rope_parameters": {"rope_type": "default"}},  # the theta: the family's default
    # The mixture-of-experts fields (the dense families ignore them, as transformers does).
    {"num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 40, "norm_topk_prob": True},
    {"num_local_experts": 6, "num_experts_per_tok": 1},
    {"decoder_sparse_step": 2},
    {"mlp_only_layers": [0]},
    {"mlp_only_layers": [0, 1]},
    {"mlp_only_layers": None, "router_jitter_noise": 0.1},
]


def write_config(folder: Path, fields: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


def family_spec(config) -> DecoderSpec:
    """The spec the engine builds for ``config``'s family."""
    module, function = _ARCHITECTURES[config.model_type]
    return getattr(importlib.import_module(module), function)(config)


def test_every_served_family_has_its_defaults():
    assert set(FAMILY_DEFAULTS) == set(_ARCHITECTURES)


@pytest.mark.parametrize("model_type", sorted(FAMILY_DEFAULTS))
def test_a_field_spelled_two_ways_is_read_as_transformers_reads_it(model_type):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    assert FIELD_ALIASES.get(model_type, {}) == CONFIG_MAPPING[model_type].attribute_map


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
@pytest.mark.parametrize("model_type", sorted(FAMILY_DEFAULTS))
def test_the_engine_reads_a_config_as_transformers_does(model_type, variant, tmp_path):
    from transformers import AutoConfig

    folder = write_config(tmp_path, {"model_type": model_type, **SHAPES, **VARIANTS[variant]})
    ours = load_model_config(folder)
    theirs = AutoConfig.from_pretrained(str(folder))
    assert family_spec(ours) == family_spec(theirs)
    head_dim = spec_from_hf_config(theirs).head_dim
    our_freq, our_scale = rope_inv_freq(ours, head_dim)
    their_freq, their_scale = rope_inv_freq(theirs, head_dim)
    assert our_scale == pytest.approx(their_scale)
    torch.testing.assert_close(our_freq, their_freq)


def test_the_bundled_model_reads_as_transformers_reads_it():
    from transformers import AutoConfig

    from kvscale.model_files import resolve_model_path

    folder = resolve_model_path(None)
    assert spec_from_hf_config(load_model_config(folder)) == spec_from_hf_config(
        AutoConfig.from_pretrained(str(folder)))


@pytest.mark.parametrize(("fields", "message"), [
    ({"model_type": "gpt2", **SHAPES},
     "model type 'gpt2' is not supported (supported: llama, mistral, mixtral, qwen2, qwen3, qwen3_moe)"),
    ({"model_type": "mixtral", **SHAPES, "num_experts": 4, "num_local_experts": 6},
     "names both num_experts (4) and num_local_experts (6)"),
    (SHAPES, "model type None is not supported"),
    ({"model_type": "llama", **{k: v for k, v in SHAPES.items() if k != "hidden_size"}}, "names no integer hidden_size"),
    ({"model_type": "llama", **SHAPES, "vocab_size": "512"}, "names no integer vocab_size"),
])
def test_a_config_the_engine_cannot_build_is_refused_with_why(fields, message, tmp_path):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model_config(write_config(tmp_path, fields))


def test_a_folder_without_a_readable_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds no JSON object"):
        load_model_config(tmp_path)
