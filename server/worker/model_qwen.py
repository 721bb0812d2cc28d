"""Qwen2 and Qwen3 on the Llama-family decoder: Qwen2 adds q/k/v biases, Qwen3 per-head q/k norms."""

from __future__ import annotations

from typing import Any

from kvscale.server.worker.model_llama import DecoderSpec, spec_from_hf_config


def qwen2_spec(config: Any) -> DecoderSpec:
    spec = spec_from_hf_config(config)
    spec.attention_bias = True  # Qwen2 always has q/k/v biases (not a config field)
    spec.o_proj_bias = False
    return spec


def qwen3_spec(config: Any) -> DecoderSpec:
    spec = spec_from_hf_config(config)
    spec.qk_norm = True
    return spec
