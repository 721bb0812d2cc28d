"""Phi-3 on the Llama-family decoder.

Its checkpoints hold q|k|v and gate|up fused already, in the order the decoder fuses them at load
(model_llama.py takes them as they are). What Phi3Config has beyond Llama's:

- ``partial_rotary_factor`` (top level or in the RoPE dict): the first fraction of each head is
  rotated, the rest passes through (rope.py, as transformers' Phi-3 attention does).
- ``longrope`` RoPE (also spelled ``su`` or ``yarn`` in older configs): transformers switches
  from the short to the long factors once a sequence passes ``original_max_position_embeddings``,
  re-rotating the whole sequence, which a KV cache of already-rotated keys cannot do. The engine
  uses the short factors and caps the model's length at ``original_max_position_embeddings``,
  where it equals transformers exactly (docs/engine.md, "The model").
- ``sliding_window``: a window over every layer, served as Mistral's is (the model's length capped
  at the window, so attention never reaches past it).
- ``hidden_act``: only SiLU, which the decoder's gated MLP computes; any other is refused.
- dropout fields: training only.
"""

from __future__ import annotations

from typing import Any

from kvscale.server.worker.model_llama import DecoderSpec, spec_from_hf_config
from kvscale.server.worker.rope import rope_parameters, rope_type

LONGROPE_TYPES = ("longrope", "su", "yarn")  # transformers' Phi-3 reads the last two as longrope


def phi3_spec(config: Any) -> DecoderSpec:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Phi-3 with hidden_act {act!r}: the engine's gated MLP computes SiLU only")
    spec = spec_from_hf_config(config)
    spec.attention_bias = spec.o_proj_bias = spec.mlp_bias = False  # Phi-3's projections have none
    params = rope_parameters(config)
    if rope_type(params) in LONGROPE_TYPES:
        original = params.get("original_max_position_embeddings") or config.original_max_position_embeddings
        spec.max_position_embeddings = min(spec.max_position_embeddings, int(original))
    return spec
