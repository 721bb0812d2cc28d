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
from kvscale.server.worker.model_gemma3 import Gemma3Spec
from kvscale.server.worker.model_llama import DecoderSpec, spec_from_hf_config
from kvscale.server.worker.model_loader import _ARCHITECTURES
from kvscale.server.worker.rope import rope_inv_freq

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

# Fields of one family, set away from their defaults, one variant each, on top of SHAPES.
FAMILY_VARIANTS: dict[str, list[dict]] = {
    # Partial rotary; longrope (its factors: 16 * 0.5 / 2 per list, for head_dim 16).
    "phi3": [
        {"partial_rotary_factor": 0.5},
        {"rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 2.5],
                          "long_factor": [3.0, 3.5, 4.0, 4.5]},
         "partial_rotary_factor": 0.5, "max_position_embeddings": 512, "original_max_position_embeddings": 128},
        {"hidden_act": "silu", "resid_pdrop": 0.1},
    ],
    # The layer pattern two ways, the local RoPE base, the attention scale, soft-capping, RoPE per layer type.
    "gemma3_text": [
        {"sliding_window_pattern": 2, "rope_local_base_freq": 500.0, "query_pre_attn_scalar": 32},
        {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 16,
         "final_logit_softcapping": 30.0},
        {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 2e5},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 3e3}}},
        {"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    ],
    # The layer pattern, the SwiGLU, the hub's older spelling of its YaRN, YaRN of its own.
    "gpt_oss": [
        {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 16, "swiglu_alpha": 1.5,
         "swiglu_limit": 3.0, "num_local_experts": 6, "num_experts_per_tok": 3},
        {"rope_theta": 150000.0, "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0,
                                                  "beta_slow": 2.0, "truncate": False,
                                                  "original_max_position_embeddings": 256}},
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                             "original_max_position_embeddings": 512}},
    ],
}
# RoPE types that are not a config of the family: transformers' config class refuses them
# (Phi3Config validates longrope alone), so there is nothing to compare against.
NOT_A_CONFIG_OF = {"phi3": {"linear", "llama3"}}


def rope_type(fields: dict) -> str | None:
    rope = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    return rope.get("rope_type") or rope.get("type")


REFUSED = [(model_type, i, fields) for model_type, types in NOT_A_CONFIG_OF.items()
           for i, fields in enumerate(VARIANTS) if rope_type(fields) in types]
CASES = [(model_type, i, fields) for model_type in sorted(FAMILY_DEFAULTS) for i, fields in enumerate(VARIANTS)
         if (model_type, i, fields) not in REFUSED] + [
    (model_type, f"own{i}", fields) for model_type, variants in FAMILY_VARIANTS.items()
    for i, fields in enumerate(variants)]


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


@pytest.mark.parametrize(("model_type", "variant", "fields"), CASES, ids=[f"{t}-{v}" for t, v, _ in CASES])
def test_the_engine_reads_a_config_as_transformers_does(model_type, variant, fields, tmp_path):
    from transformers import AutoConfig

    folder = write_config(tmp_path, {"model_type": model_type, **SHAPES, **fields})
    ours = load_model_config(folder)
    theirs = AutoConfig.from_pretrained(str(folder))
    our_spec, their_spec = family_spec(ours), family_spec(theirs)
    assert our_spec == their_spec
    head_dim = their_spec.head_dim
    # Gemma 3: one RoPE per layer type, each from the spec's parameters; the others: the config's.
    kinds = our_spec.rope if isinstance(our_spec, Gemma3Spec) else {None: None}
    for kind, params in kinds.items():
        their_params = their_spec.rope[kind] if isinstance(their_spec, Gemma3Spec) and kind else None
        our_freq, our_scale = rope_inv_freq(ours, head_dim, params, layer_type=kind)
        their_freq, their_scale = rope_inv_freq(theirs, head_dim, their_params, layer_type=kind)
        assert our_scale == pytest.approx(their_scale)
        torch.testing.assert_close(our_freq, their_freq)


@pytest.mark.parametrize(("model_type", "variant", "fields"), REFUSED, ids=[f"{t}-{v}" for t, v, _ in REFUSED])
def test_the_variants_left_out_are_refused_by_transformers(model_type, variant, fields, tmp_path):
    from transformers import AutoConfig

    with pytest.raises(Exception, match="rope"):
        AutoConfig.from_pretrained(str(write_config(tmp_path, {"model_type": model_type, **SHAPES, **fields})))


def test_the_bundled_model_reads_as_transformers_reads_it():
    from transformers import AutoConfig

    from kvscale.model_files import resolve_model_path

    folder = resolve_model_path(None)
    assert spec_from_hf_config(load_model_config(folder)) == spec_from_hf_config(
        AutoConfig.from_pretrained(str(folder)))


@pytest.mark.parametrize(("fields", "message"), [
    ({"model_type": "gpt2", **SHAPES},
     "model type 'gpt2' is not supported (supported: gemma3_text, gpt_oss, llama, mistral, mixtral, phi3, qwen2, "
     "qwen3, qwen3_moe)"),
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
    with pytest.raises(ValueError, match="config.json: not JSON"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json: expected a JSON object, got list"):
        load_model_config(tmp_path)


@pytest.mark.parametrize(("fields", "message"), [
    ({"model_type": "phi3", "hidden_act": "gelu"}, "Phi-3 with hidden_act 'gelu'"),
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "Gemma 3 with attn_logit_softcapping=50.0"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "Gemma 3 with use_bidirectional_attention"),
    ({"model_type": "gemma3_text", "hidden_activation": "gelu"}, "Gemma 3 with hidden_activation 'gelu'"),
    ({"model_type": "gemma3_text", "layer_types": ["sliding_attention"]}, "layer_types"),
    ({"model_type": "gpt_oss", "layer_types": ["sliding_attention"]}, "layer_types"),
    ({"model_type": "gpt_oss", "quantization_config": {"quant_method": "fp8"}},
     "gpt-oss checkpoint quantized with 'fp8'"),  # MXFP4 experts are decoded at load
])
def test_a_field_the_engine_cannot_honour_is_refused_at_load(fields, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        family_spec(load_model_config(write_config(tmp_path, {**SHAPES, **fields})))
