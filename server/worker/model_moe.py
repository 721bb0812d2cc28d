"""Mixtral and Qwen3-MoE on the Llama-family decoder: which layers are a sparse mixture of experts
(server/worker/moe.py), how many experts, how each token is routed, and how the family's
checkpoints name them. Attention is Mistral's (Mixtral) and Qwen3's, q/k norms included (Qwen3-MoE).

Mixtral: every layer sparse; softmax over all experts, top-k, renormalized. Qwen3-MoE: a layer is
sparse unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` (those keep a dense
MLP of ``intermediate_size``); the top-k renormalized only with ``norm_topk_prob``. The router's
training-time fields (``router_jitter_noise``, the auxiliary loss) do nothing at inference.
"""

from __future__ import annotations

from typing import Any

from kvscale.server.worker.model_llama import DecoderSpec, spec_from_hf_config
from kvscale.server.worker.model_qwen import qwen3_spec
from kvscale.server.worker.moe import MoeSpec, check_moe_spec


def _with_experts(spec: DecoderSpec, moe: MoeSpec) -> DecoderSpec:
    if moe.layers:  # a model whose layers are all dense routes nothing, whatever its expert fields say
        check_moe_spec(moe)
        spec.moe = moe
    spec.mlp_bias = False  # neither family's MLPs have biases, whatever the config says
    return spec


def mixtral_spec(config: Any) -> DecoderSpec:
    return _with_experts(spec_from_hf_config(config), MoeSpec(
        num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
        intermediate_size=config.intermediate_size, norm_topk_prob=True, round_weights=False,
        layers=tuple(range(config.num_hidden_layers)),
        checkpoint_block="block_sparse_moe", checkpoint_experts=("w1", "w3", "w2"),
    ))


def qwen3_moe_spec(config: Any) -> DecoderSpec:
    num_experts, step = config.num_local_experts, config.decoder_sparse_step
    if step < 1:
        raise ValueError(f"decoder_sparse_step {step} names no layer")
    dense = set(config.mlp_only_layers or ())
    sparse = tuple(i for i in range(config.num_hidden_layers)
                   if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    moe = MoeSpec(num_experts=num_experts, top_k=config.num_experts_per_tok,
                  intermediate_size=config.moe_intermediate_size, norm_topk_prob=bool(config.norm_topk_prob),
                  round_weights=True, layers=sparse)
    return _with_experts(qwen3_spec(config), moe)
