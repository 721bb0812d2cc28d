"""Llama-family decoder (Llama, SmolLM, TinyLlama, Mistral) over a paged KV cache.

The same block also serves Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm); see
model_qwen.py for how those configs map onto :class:`DecoderSpec`. Mixtral and Qwen3-MoE replace
the MLP of some or all layers with a sparse mixture of experts (moe.py, model_moe.py). Phi-3 is
this decoder as it is (model_phi3.py); Gemma 3 keeps its attention and projections around layers
of its own (model_gemma3.py).

Projections are fused at load time (q|k|v into one matrix, gate|up into another) so a layer
is four matmuls. Numerics follow transformers (RMSNorm in float32, rotate-half RoPE), so
greedy decoding matches it token for token in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvscale.kernels import layer_ops
from kvscale.server.worker.attention_metadata import AttentionMetadata
from kvscale.server.worker.cpu_linear import lay_out_cpu_linears
from kvscale.server.worker.cpu_step_layers import CpuStepLayers
from kvscale.server.worker.moe import MoeSpec, SparseMoeBlock, moe_weights
from kvscale.server.worker.quantization import quantize_linears
from kvscale.server.worker.rope import apply_rope, cos_sin_table, rope_inv_freq


@dataclass
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v biases
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    moe: MoeSpec | None = None  # the sparse layers' experts; None: every layer dense


def spec_from_hf_config(config: Any) -> DecoderSpec:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    return DecoderSpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(config, "attention_bias", False)),
        o_proj_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        sliding_window=window,
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_ops.add_rms_norm(x, None, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x`` in place (the sum that closes a sublayer) and its norm (which opens
        the next), in one pass where a kernel does both."""
        return layer_ops.add_rms_norm(x, residual, self.weight, self.eps), residual


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_proj_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        # Whether cos/sin repeat their first half in their second (not with partial rotary,
        # which rotates the first rotary_dim dimensions of a head only).
        self.rope_halves_repeat = True
        self.rotary_dim = spec.head_dim
        # An FP8 KV cache's per-tensor scales (vLLM's k_scale/v_scale; kernels/fp8.py): 1.0, as
        # vLLM has them for a checkpoint that brings none (no loader reads them yet).
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None or not self.rope_halves_repeat:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(num_tokens, self.num_heads, self.head_dim)
            k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q = apply_rope(q, cos, sin, self.rotary_dim)
            k = apply_rope(k, cos, sin, self.rotary_dim)
        else:
            # q and k rotated together, one set of ops for all heads.
            heads = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
            qk = layer_ops.rope(heads, cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        ops = meta.kernels
        k_scale, v_scale = self.k_scale, self.v_scale
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
        out = self.attend(q, k_cache, v_cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """Causal attention of this step's queries over the paged cache, their own keys written."""
        ops = meta.kernels
        k_scale, v_scale = self.k_scale, self.v_scale
        if meta.is_decode:
            out = ops.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale,
                                             k_scale=k_scale, v_scale=v_scale)
        elif meta.split is not None:
            split = meta.split
            out = q.new_empty(q.shape)
            out[split.decode_rows] = ops.paged_decode_attention(
                q[split.decode_rows], k_cache, v_cache, split.decode_block_tables, split.decode_context_lens,
                self.scale, k_scale=k_scale, v_scale=v_scale,
            )
            out[split.prefill_rows] = ops.paged_prefill_attention(
                q[split.prefill_rows], k_cache, v_cache, split.prefill_block_tables, split.prefill_query_start_loc,
                split.prefill_context_lens, self.scale, max_query_len=meta.max_query_len,
                k_scale=k_scale, v_scale=v_scale,
            )
        else:
            out = ops.paged_prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens, self.scale,
                max_query_len=meta.max_query_len, k_scale=k_scale, v_scale=v_scale,
            )
        return out


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(layer_ops.projected_silu_and_mul(self.gate_up_proj, x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp: MLP | SparseMoeBlock = (SparseMoeBlock(spec.moe, spec.hidden_size)
                                          if spec.moe is not None and index in spec.moe.layers else MLP(spec))

    def forward(self, hidden, residual, cos, sin, k_cache, v_cache, meta):
        """This layer's output before its closing residual add, and the residual stream: each
        add is fused with the norm after it (the next layer's, or the model's final one)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, k_cache, v_cache, meta)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderForCausalLM(nn.Module):
    # Each layer's norms, checkpoint and module named alike (Gemma 3 has four).
    layer_norm_names: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    # Why a GPU cannot capture this model's decode steps as CUDA graphs; None where it can.
    graph_capture_blocker: str | None = None
    # A family with layers of its own names its spec's class: a model built from such a spec is
    # the family's, whoever builds it (a tensor-parallel rank builds every family's shard here).
    spec_class: type | None = None
    _family_of: dict[type, type] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("spec_class") is not None:
            DecoderForCausalLM._family_of[cls.__dict__["spec_class"]] = cls

    def __new__(cls, *args: Any, **kwargs: Any) -> DecoderForCausalLM:
        # No arguments when copy or pickle rebuilds an instance: its own class then.
        spec = args[0] if args else kwargs.get("spec")
        family = DecoderForCausalLM._family_of.get(type(spec), cls)
        return super().__new__(family if issubclass(family, cls) else cls)

    def __init__(self, spec: DecoderSpec, hf_config: Any) -> None:
        super().__init__()
        self.spec = spec
        # Given its (empty) weight, the embedding skips its random init, which on the meta device
        # runs through torch._refs and imports torch._dynamo (2-4 s of an engine's start); the
        # checkpoint's weights replace it anyway.
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size,
                                         _weight=torch.empty(spec.vocab_size, spec.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self._hf_config = hf_config
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        # Built at the first step (the weights' final layout is known by then).
        self._cpu_step_layers: CpuStepLayers | None = None
        self._cpu_step_layers_checked = False
        # Called between runs of layers on the one-call path, as the layers' forward pre-hooks
        # are on the modules' (a step given up for a more urgent arrival: server/core/step_interrupt.py).
        self.one_call_check: Callable[[], None] | None = None

    def build_rope_cache(self, max_len: int) -> None:
        """cos/sin for every position once, computed exactly as transformers does per step."""
        if self._cos_sin is not None and self._cos_sin[0].shape[0] >= max_len:
            return  # engines sharing these weights may ask for different lengths
        inv_freq, scaling = rope_inv_freq(self._hf_config, self.spec.head_dim)
        self._cos_sin = cos_sin_table(inv_freq, scaling, self.spec.head_dim, max_len, self.embed_tokens.weight)
        for module in self.modules():
            if isinstance(module, Attention):
                module.rotary_dim = 2 * inv_freq.shape[0]
                module.rope_halves_repeat = module.rotary_dim == self.spec.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` for the chosen rows of the flattened batch."""
        return self.compute_logits(self.hidden_states(input_ids, positions, kv_caches, meta, logits_indices))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The final norm's output ``[len(logits_indices), hidden]`` for the chosen rows (what a
        CUDA graph of a decode step keeps: far smaller than its logits)."""
        assert self._cos_sin is not None, "build_rope_cache first"
        cos_table, sin_table = self._cos_sin
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        one_call = self._one_call_layers(hidden.shape[0], kv_caches, meta)
        if one_call is not None:
            hidden, residual = one_call.run(hidden, positions, cos_table, sin_table, kv_caches, meta,
                                            self.one_call_check)
        else:
            cos = cos_table.index_select(0, positions).unsqueeze(1)  # broadcast over heads
            sin = sin_table.index_select(0, positions).unsqueeze(1)
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
                hidden, residual = layer(hidden, residual, cos, sin, k_cache, v_cache, meta)
        assert residual is not None, "a model without layers"
        hidden, _ = self.norm.add_and_norm(hidden.index_select(0, logits_indices),
                                           residual.index_select(0, logits_indices))
        return hidden

    def _one_call_layers(self, rows: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                         meta: AttentionMetadata) -> CpuStepLayers | None:
        """The one-call path for this step's layers (server/worker/cpu_step_layers.py), where it applies."""
        if not self._cpu_step_layers_checked:
            self._cpu_step_layers = CpuStepLayers.for_model(self)
            self._cpu_step_layers_checked = True
        step = self._cpu_step_layers
        return step if step is not None and step.applies(rows, kv_caches, meta) else None

    def _dense_mlp_weights(self, take: Callable[[str], torch.Tensor], prefix: str,
                           weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint layer ``prefix``'s dense MLP, gate and up fused, named as the layer names it."""
        names = ["weight", "bias"] if self.spec.mlp_bias else ["weight"]
        if f"{prefix}mlp.gate_up_proj.weight" in weights:
            return {f"mlp.{proj}.{n}": take(f"{prefix}mlp.{proj}.{n}") for proj in ("gate_up_proj", "down_proj")
                    for n in names}
        loaded = {f"mlp.gate_up_proj.{n}": torch.cat([take(f"{prefix}mlp.gate_proj.{n}"),
                                                      take(f"{prefix}mlp.up_proj.{n}")]) for n in names}
        loaded.update({f"mlp.down_proj.{n}": take(f"{prefix}mlp.down_proj.{n}") for n in names})
        return loaded

    def _mlp_weights(self, take: Callable[[str], torch.Tensor], weights: dict[str, torch.Tensor], prefix: str,
                     index: int) -> dict[str, torch.Tensor]:
        """Checkpoint layer ``prefix``'s MLP or experts (and whatever else a family's layer adds),
        named under the layer as it names them."""
        moe = self.spec.moe
        if moe and index in moe.layers:
            return moe_weights(take, weights, prefix, moe)
        return self._dense_mlp_weights(take, prefix, weights)

    def load_hf_weights(self, weights: dict[str, torch.Tensor], quantization: str | None = None) -> None:
        """Fill this module from a transformers-named state dict (fusing q/k/v and gate/up), then
        quantize its projections (``quantization``) or lay them out for the CPU's GEMM."""
        own = self.state_dict()
        consumed: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint lacks weight {name!r}")
            consumed.add(name)
            return weights[name]

        loaded: dict[str, torch.Tensor] = {}
        strip = "model."
        for i in range(self.spec.num_layers):
            p = f"{strip}layers.{i}."
            attn = p + "self_attn."
            # Phi-3's checkpoints hold q|k|v (and gate|up) fused already, in this module's order.
            fused = attn + "qkv_proj.weight"
            loaded[f"layers.{i}.self_attn.qkv_proj.weight"] = take(fused) if fused in weights else torch.cat(
                [take(attn + f"{n}_proj.weight") for n in ("q", "k", "v")]
            )
            if self.spec.attention_bias:
                loaded[f"layers.{i}.self_attn.qkv_proj.bias"] = torch.cat(
                    [take(attn + f"{n}_proj.bias") for n in ("q", "k", "v")]
                )
            loaded[f"layers.{i}.self_attn.o_proj.weight"] = take(attn + "o_proj.weight")
            if self.spec.o_proj_bias:
                loaded[f"layers.{i}.self_attn.o_proj.bias"] = take(attn + "o_proj.bias")
            if self.spec.qk_norm:
                loaded[f"layers.{i}.self_attn.q_norm.weight"] = take(attn + "q_norm.weight")
                loaded[f"layers.{i}.self_attn.k_norm.weight"] = take(attn + "k_norm.weight")
            loaded.update({f"layers.{i}.{name}": tensor for name, tensor in self._mlp_weights(take, weights, p, i).items()})
            for norm in self.layer_norm_names:
                loaded[f"layers.{i}.{norm}.weight"] = take(p + f"{norm}.weight")
        loaded["embed_tokens.weight"] = take(strip + "embed_tokens.weight")
        loaded["norm.weight"] = take(strip + "norm.weight")
        if self.spec.tie_word_embeddings or "lm_head.weight" not in weights:
            loaded["lm_head.weight"] = loaded["embed_tokens.weight"]
        else:
            loaded["lm_head.weight"] = take("lm_head.weight")
        unused = {n for n in set(weights) - consumed if "rotary_emb" not in n and n != "lm_head.weight"}
        if unused:
            # Weights this code would silently ignore mean an architecture variant it lacks.
            raise ValueError(f"checkpoint has weights kvscale's model does not use: {sorted(unused)[:5]}")
        missing = set(own) - set(loaded)
        if missing:
            raise ValueError(f"checkpoint lacks weights for {sorted(missing)[:5]}...")
        for name, tensor in loaded.items():
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(own[name].shape)}"
                )
        self.load_state_dict(loaded, strict=True)
        # The fused copies and the state dict's references to the old parameters would
        # otherwise stay alive while the layout below copies every projection again: the
        # load's peak held the weights three times (2.7 GB for a 540 MB fp32 model).
        del loaded, own
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if quantization is not None:
            quantize_linears(self)
        elif self.lm_head.weight.device.type == "cpu":
            lay_out_cpu_linears(self)
        self._cpu_step_layers_checked = False  # the layers' weights are laid out anew
