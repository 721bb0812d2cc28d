"""Gemma 3 (text) on the decoder's attention and projections.

What differs from Llama, following transformers' ``modeling_gemma3``:

- RMSNorm scales by ``1 + weight`` in float32 (the checkpoint stores the offset from 1), for the
  hidden states and the per-head q/k norms alike.
- Four norms a layer: each sublayer's output is normed before its residual add too.
- The MLP is GeGLU: tanh-approximated GELU of the gate times the up projection.
- Embeddings are scaled by sqrt(hidden_size); attention by ``query_pre_attn_scalar**-0.5``.
- Layers are local (a sliding window of ``sliding_window`` tokens, their own RoPE base) or global
  (full causal attention), as ``layer_types`` lists them, or, in older configs, every
  ``sliding_window_pattern``-th layer global. Local layers attend through window_attention.py.
- Final logits are soft-capped where ``final_logit_softcapping`` is set. Attention soft-capping
  (``attn_logit_softcapping``, Gemma 2's) and bidirectional attention are refused: the kernels
  have neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvscale.server.worker.attention_metadata import AttentionMetadata
from kvscale.server.worker.model_llama import (
    MLP,
    Attention,
    DecoderForCausalLM,
    DecoderSpec,
    RMSNorm,
    spec_from_hf_config,
)
from kvscale.server.worker.rope import cos_sin_table, rope_inv_freq
from kvscale.server.worker.window_attention import paged_window_attention

FULL, SLIDING = "full_attention", "sliding_attention"
# transformers' Gemma3TextConfig.default_theta: the global and the local layers' RoPE bases.
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


@dataclass
class Gemma3Spec(DecoderSpec):
    query_pre_attn_scalar: float = 256.0
    layer_windows: tuple[int | None, ...] = ()  # each layer's window; None: a global layer
    rope: dict[str, dict[str, Any]] = field(default_factory=dict)  # layer type -> its RoPE parameters
    final_logit_softcapping: float | None = None


def layer_types(config: Any) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:
        pattern = getattr(config, "sliding_window_pattern", 6)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]
    if len(types) != config.num_hidden_layers or set(types) - {FULL, SLIDING}:
        raise ValueError(f"layer_types {types} is not one of {FULL!r} or {SLIDING!r} per layer")
    return list(types)


def rope_parameters(config: Any) -> dict[str, dict[str, Any]]:
    """Each layer type's RoPE dict, built from the config as transformers' Gemma3TextConfig
    builds it: ``rope_parameters`` per layer type, or the older ``rope_scaling`` (global layers),
    ``rope_theta`` and ``rope_local_base_freq``."""
    given = getattr(config, "rope_parameters", None) or {}
    params = {kind: dict(given.get(kind) or {"rope_type": "default"}) for kind in (FULL, SLIDING)}
    scaling = getattr(config, "rope_scaling", None) or {}
    if FULL not in scaling:  # transformers' own config answers rope_scaling with rope_parameters
        params[FULL].update(scaling)
    params[FULL].setdefault("rope_theta", getattr(config, "rope_theta", None) or DEFAULT_THETA[FULL])
    params[SLIDING].setdefault("rope_theta", getattr(config, "rope_local_base_freq", None) or DEFAULT_THETA[SLIDING])
    for kind in params:  # "type" is the older spelling of "rope_type"
        params[kind].setdefault("rope_type", params[kind].pop("type", "default"))
    return params


def gemma3_spec(config: Any) -> Gemma3Spec:
    for refused in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if getattr(config, refused, None):
            raise ValueError(f"Gemma 3 with {refused}={getattr(config, refused)!r}: the engine's attention "
                             "kernels have no such mode")
    act = getattr(config, "hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 3 with hidden_activation {act!r}: the engine computes gelu_pytorch_tanh only")
    base = spec_from_hf_config(config)
    base.sliding_window = None  # per layer below: the model's length is not capped at the window
    base.qk_norm = True
    base.o_proj_bias = base.attention_bias  # transformers' Gemma 3 gives o_proj the bias too
    base.mlp_bias = False
    window = config.sliding_window
    return Gemma3Spec(
        **vars(base),
        query_pre_attn_scalar=float(config.query_pre_attn_scalar),
        layer_windows=tuple(window if kind == SLIDING else None for kind in layer_types(config)),
        rope=rope_parameters(config),
        final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
    )


class GemmaRMSNorm(RMSNorm):
    """RMSNorm times ``1 + weight``, all in float32 before the cast back (transformers' order)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual.add_(x)
        return self(residual), residual


class Gemma3Attention(Attention):
    def __init__(self, spec: Gemma3Spec, window: int | None) -> None:
        super().__init__(spec)
        self.q_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.scale = spec.query_pre_attn_scalar**-0.5
        self.window = window

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.window is not None and meta.window is not None:
            meta = meta.window  # the window group's slots and tables (server/worker/kv_groups.py)
        return super().forward(hidden, cos, sin, k_cache, v_cache, meta)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        if self.window is None:
            return super().attend(q, k_cache, v_cache, meta)
        return paged_window_attention(q, k_cache, v_cache, meta, self.scale, self.window,
                                      k_scale=self.k_scale, v_scale=self.v_scale)


class GegluMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, spec: Gemma3Spec, index: int) -> None:
        super().__init__()
        self.is_sliding = spec.layer_windows[index] is not None
        self.self_attn = Gemma3Attention(spec, spec.layer_windows[index])
        self.mlp = GegluMLP(spec)
        self.input_layernorm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, hidden, residual, cos, sin, k_cache, v_cache, meta):
        """As the Llama layer's: the output before its closing residual add, and the stream."""
        stream = hidden if residual is None else residual + hidden
        out = self.self_attn(self.input_layernorm(stream), cos, sin, k_cache, v_cache, meta)
        stream = stream + self.post_attention_layernorm(out)
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(stream))), stream


class Gemma3ForCausalLM(DecoderForCausalLM):
    layer_norm_names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                        "post_feedforward_layernorm")
    spec: Gemma3Spec
    spec_class = Gemma3Spec

    def __init__(self, spec: Gemma3Spec, hf_config: Any) -> None:
        super().__init__(spec, hf_config)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if any(w is not None for w in spec.layer_windows):
            self.graph_capture_blocker = ("its sliding-window layers read each sequence's length back to the "
                                          "host (server/worker/window_attention.py)")

    def build_rope_cache(self, max_len: int) -> None:
        """One cos/sin table per layer type: local and global layers have their own RoPE."""
        if self._tables and self._tables[FULL][0].shape[0] >= max_len:
            return
        for kind, params in self.spec.rope.items():
            inv_freq, scaling = rope_inv_freq(self._hf_config, self.spec.head_dim, params, layer_type=kind)
            self._tables[kind] = cos_sin_table(inv_freq, scaling, self.spec.head_dim, max_len,
                                               self.embed_tokens.weight)
        self._cos_sin = self._tables[FULL]
        for module in self.modules():
            if isinstance(module, Attention):
                module.rope_halves_repeat = False  # q/k norms first: the rotation runs per tensor

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                      logits_indices: torch.Tensor) -> torch.Tensor:
        assert self._tables, "build_rope_cache first"
        weight = self.embed_tokens.weight
        hidden = self.embed_tokens(input_ids) * torch.tensor(self.spec.hidden_size**0.5, dtype=weight.dtype)
        rows = {kind: (cos.index_select(0, positions).unsqueeze(1), sin.index_select(0, positions).unsqueeze(1))
                for kind, (cos, sin) in self._tables.items()}
        residual: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            cos, sin = rows[SLIDING if layer.is_sliding else FULL]
            hidden, residual = layer(hidden, residual, cos, sin, k_cache, v_cache, meta)
        assert residual is not None, "a model without layers"
        hidden, _ = self.norm.add_and_norm(hidden.index_select(0, logits_indices),
                                           residual.index_select(0, logits_indices))
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
