"""gpt-oss on the decoder's attention, norms and mixture-of-experts block.

What differs from Mixtral, following transformers' ``modeling_gpt_oss``:

- q/k/v and o projections have biases; each head has a learned attention sink, a logit added to
  the softmax's denominator that attends to no value. The C and Triton kernels cannot add it, so
  every layer attends through window_attention.py in PyTorch (docs/engine.md, "The model").
- Layers alternate between a sliding window of ``sliding_window`` tokens and full causal
  attention, as ``layer_types`` lists them (by default the even layers local); all share one RoPE,
  YaRN by default, computed by transformers (rope.py) with its attention scaling.
- The router has a bias and takes the top-k of its logits, then a softmax over those k alone,
  in the model's dtype.
- Each expert's projections have biases and a clamped SwiGLU: the gate clamped above at
  ``swiglu_limit``, the up projection on both sides, ``(up + 1) * gate * sigmoid(alpha * gate)``.
- Checkpoints stack the experts as transformers holds them: ``gate_up_proj`` ``[experts, hidden,
  2 * intermediate]`` multiplied from the right, gate and up interleaved column by column,
  ``down_proj`` ``[experts, intermediate, hidden]``, and a bias for each. The hub's own hold the
  projections in MXFP4 (``_blocks`` and ``_scales``, quantization_config ``mxfp4``): decoded to
  the model's dtype layer by layer as they load (mxfp4.py); there is no MXFP4 kernel here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvscale.server.worker.attention_metadata import AttentionMetadata
from kvscale.server.worker.model_llama import (
    Attention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderSpec,
    spec_from_hf_config,
)
from kvscale.server.worker.moe import MoeSpec, SparseMoeBlock, check_moe_spec
from kvscale.server.worker.mxfp4 import BLOCK, decode_experts, mxfp4_refusal
from kvscale.server.worker.window_attention import paged_window_attention

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass
class GptOssSpec(DecoderSpec):
    layer_windows: tuple[int | None, ...] = ()  # each layer's window; None: full attention
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


def _quantization_method(config: Any) -> str | None:
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(method or "unknown")


def layer_types(config: Any) -> list[str]:
    """Each layer's kind, defaulted as transformers' GptOssConfig does: even layers local."""
    types = getattr(config, "layer_types", None)
    if types is None:
        types = [SLIDING if (i + 1) % 2 else FULL for i in range(config.num_hidden_layers)]
    if len(types) != config.num_hidden_layers or set(types) - {FULL, SLIDING}:
        raise ValueError(f"layer_types {types} is not one of {FULL!r} or {SLIDING!r} per layer")
    return list(types)


def gpt_oss_spec(config: Any) -> GptOssSpec:
    method = _quantization_method(config)
    if method not in (None, "mxfp4"):
        raise ValueError(f"gpt-oss checkpoint quantized with {method!r}: the engine loads unquantized "
                         "(bfloat16 or float32) or MXFP4 experts only; dequantize it first")
    base = spec_from_hf_config(config)
    base.sliding_window = None  # per layer below: the model's length is not capped at the window
    base.o_proj_bias = base.attention_bias
    base.mlp_bias = False
    moe = MoeSpec(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                  intermediate_size=config.intermediate_size, norm_topk_prob=True, round_weights=True,
                  layers=tuple(range(config.num_hidden_layers)))
    check_moe_spec(moe)
    base.moe = moe
    window = getattr(config, "sliding_window", None)
    return GptOssSpec(
        **vars(base),
        layer_windows=tuple(window if kind == SLIDING else None for kind in layer_types(config)),
        swiglu_alpha=float(config.swiglu_alpha),
        swiglu_limit=float(config.swiglu_limit),
    )


class GptOssAttention(Attention):
    def __init__(self, spec: GptOssSpec, window: int | None) -> None:
        super().__init__(spec)
        self.sinks = nn.Parameter(torch.empty(spec.num_heads))
        self.window = window

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.window is not None and meta.window is not None:
            meta = meta.window  # the window group's slots and tables (server/worker/kv_groups.py)
        return super().forward(hidden, cos, sin, k_cache, v_cache, meta)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        return paged_window_attention(q, k_cache, v_cache, meta, self.scale, self.window,
                                      k_scale=self.k_scale, v_scale=self.v_scale, sinks=self.sinks)


class GptOssExpert(nn.Module):
    """One expert: the clamped SwiGLU, its gate and up projections fused (gate first) with biases."""

    def __init__(self, spec: GptOssSpec, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.alpha, self.limit = spec.swiglu_alpha, spec.swiglu_limit
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * intermediate_size, bias=True)
        self.down_proj = nn.Linear(intermediate_size, spec.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class GptOssMoeBlock(SparseMoeBlock):
    """moe.py's block with gpt-oss's router (a bias; softmax over the top-k logits) and experts."""

    def __init__(self, spec: GptOssSpec) -> None:
        assert spec.moe is not None
        super().__init__(spec.moe, spec.hidden_size)
        self.gate = nn.Linear(spec.hidden_size, spec.moe.num_experts, bias=True)
        self.experts = nn.ModuleList(GptOssExpert(spec, spec.moe.intermediate_size)
                                     for _ in range(spec.moe.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, experts = torch.topk(self.gate(x), self.moe.top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts


class GptOssDecoderLayer(DecoderLayer):
    """The Llama layer (two RMSNorms around attention and the MLP) with gpt-oss's sublayers."""

    def __init__(self, spec: GptOssSpec, index: int) -> None:
        super().__init__(spec, index)
        self.self_attn = GptOssAttention(spec, spec.layer_windows[index])
        self.mlp = GptOssMoeBlock(spec)


class GptOssForCausalLM(DecoderForCausalLM):
    spec: GptOssSpec
    spec_class = GptOssSpec
    graph_capture_blocker = ("its attention reads each sequence's length back to the host "
                             "(server/worker/window_attention.py)")

    def __init__(self, spec: GptOssSpec, hf_config: Any) -> None:
        super().__init__(spec, hf_config)
        self.layers = nn.ModuleList(GptOssDecoderLayer(spec, i) for i in range(spec.num_layers))

    def load_hf_weights(self, weights: dict[str, torch.Tensor], quantization: str | None = None) -> None:
        why = mxfp4_refusal(list(weights))
        if why is not None:
            raise ValueError(why)
        super().load_hf_weights(weights, quantization)

    def _expert_projection(self, take: Callable[[str], torch.Tensor], weights: dict[str, torch.Tensor],
                           name: str, shape: tuple[int, int, int]) -> torch.Tensor:
        """A stacked projection as transformers holds it (``shape``: ``[experts, in, out]``), from
        its unquantized tensor or decoded from its MXFP4 blocks and scales (mxfp4.py)."""
        if name + "_blocks" not in weights:
            return take(name)
        experts, inputs, outputs = shape
        blocks, scales = take(name + "_blocks"), take(name + "_scales")
        if inputs % BLOCK:
            raise ValueError(f"checkpoint weight {name}: MXFP4 blocks of {BLOCK} do not tile its input dimension {inputs}")
        groups = inputs // BLOCK
        for tensor, expected in ((blocks, (experts, outputs, groups, BLOCK // 2)), (scales, (experts, outputs, groups))):
            if tuple(tensor.shape) != expected:
                raise ValueError(f"checkpoint weight {name}_{'blocks' if tensor is blocks else 'scales'}: shape "
                                 f"{tuple(tensor.shape)}, the config implies {expected}")
        return decode_experts(blocks, scales, self.embed_tokens.weight.dtype)

    def _mlp_weights(self, take: Callable[[str], torch.Tensor], weights: dict[str, torch.Tensor], prefix: str,
                     index: int) -> dict[str, torch.Tensor]:
        """The layer's router, experts and attention sinks, each expert's gate|up de-interleaved
        and every projection transposed into ``nn.Linear``'s ``[out, in]``."""
        stacked = f"{prefix}mlp.experts."
        moe = self.spec.moe
        assert moe is not None
        hidden, inter = self.spec.hidden_size, moe.intermediate_size
        gate_up = self._expert_projection(take, weights, stacked + "gate_up_proj", (moe.num_experts, hidden, 2 * inter))
        down = self._expert_projection(take, weights, stacked + "down_proj", (moe.num_experts, inter, hidden))
        gate_up_bias, down_bias = take(stacked + "gate_up_proj_bias"), take(stacked + "down_proj_bias")
        expected = {"gate_up_proj": (moe.num_experts, hidden, 2 * inter), "gate_up_proj_bias": (moe.num_experts, 2 * inter),
                    "down_proj": (moe.num_experts, inter, hidden), "down_proj_bias": (moe.num_experts, hidden)}
        for name, tensor in zip(expected, (gate_up, gate_up_bias, down, down_bias), strict=True):
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(f"checkpoint weight {stacked}{name}: shape {tuple(tensor.shape)}, the config "
                                 f"implies {expected[name]}")
        loaded = {"mlp.gate.weight": take(f"{prefix}mlp.router.weight"),
                  "mlp.gate.bias": take(f"{prefix}mlp.router.bias"),
                  "self_attn.sinks": take(f"{prefix}self_attn.sinks")}
        for e in range(moe.num_experts):
            weight, bias = gate_up[e].t(), gate_up_bias[e]  # rows: gate, up, gate, up, ...
            loaded[f"mlp.experts.{e}.gate_up_proj.weight"] = torch.cat([weight[0::2], weight[1::2]])
            loaded[f"mlp.experts.{e}.gate_up_proj.bias"] = torch.cat([bias[0::2], bias[1::2]])
            loaded[f"mlp.experts.{e}.down_proj.weight"] = down[e].t().contiguous()
            loaded[f"mlp.experts.{e}.down_proj.bias"] = down_bias[e]
        return loaded
