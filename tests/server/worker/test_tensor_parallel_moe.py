"""Mixture-of-experts models split over 2 gloo ranks decode greedily as one engine does: each
expert's intermediate dimension split, the router whole on every rank. Tiny random-weight
checkpoints in the hub's per-expert names: Qwen3-MoE with a dense layer among its sparse ones
(two intermediate widths, q/k norms), and Mixtral (w1/w3/w2 experts)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvscale.server.config import EngineConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_checkpoints import copy_tokenizer, decoder_layer_shapes, save_random_weights  # noqa: E402

VOCAB = 512


def _write_checkpoint(path, arch: str) -> None:
    """config.json and random weights in the hub's names (tests/server/tiny_checkpoints.py)."""
    import json

    hidden, inter, experts, expert_inter, heads, kv_heads, head_dim = 64, 96, 4, 32, 4, 2, 16
    config = {"vocab_size": VOCAB, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": 2,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
              "num_experts_per_tok": 2}
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, hidden), "lm_head.weight": (VOCAB, hidden),
                                          "model.norm.weight": (hidden,)}
    if arch == "qwen3_moe":  # layer 0 sparse, layer 1 dense; q/k norms
        config.update(model_type="qwen3_moe", head_dim=head_dim, num_experts=experts,
                      moe_intermediate_size=expert_inter, mlp_only_layers=[1], norm_topk_prob=True,
                      decoder_sparse_step=1)
        block, names = "mlp", ("gate_proj", "up_proj", "down_proj")
    else:
        config.update(model_type="mixtral", num_local_experts=experts, sliding_window=None)
        expert_inter = inter
        block, names = "block_sparse_moe", ("w1", "w3", "w2")
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update(decoder_layer_shapes(p, hidden, heads, kv_heads, head_dim, inter=None))
        if arch == "qwen3_moe":
            shapes.update({p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)})
        if arch == "qwen3_moe" and i == 1:
            shapes.update({p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                           p + "mlp.down_proj.weight": (hidden, inter)})
            continue
        shapes[f"{p}{block}.gate.weight"] = (experts, hidden)
        for e in range(experts):
            x = f"{p}{block}.experts.{e}."
            shapes.update({x + f"{names[0]}.weight": (expert_inter, hidden), x + f"{names[1]}.weight": (expert_inter, hidden),
                           x + f"{names[2]}.weight": (hidden, expert_inter)})
    save_random_weights(path, shapes, 0.1, norm_jitter=0.1)
    (path / "config.json").write_text(json.dumps(config))


def _tokens(path, arch: str, size: int) -> dict[str, list[int]]:
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", num_gpu_blocks_override=64,
                                    block_size=8, max_num_batched_tokens=24, tensor_parallel_size=size))
    gen = torch.Generator().manual_seed(1)
    try:
        moe = engine.runner.model.spec.moe
        assert moe is not None and moe.layers == ((0,) if arch == "qwen3_moe" else (0, 1)), moe
        for i, n in enumerate((6, 30)):
            engine.add_request(str(i), torch.randint(3, VOCAB, (n,), generator=gen).tolist(),
                               SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({out.request_id: list(out.outputs[0].token_ids) for out in engine.step() if out.finished})
        return finished
    finally:
        if size > 1:
            engine.runner.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_two_ranks_decode_a_mixture_of_experts_as_one(arch, tmp_path, bundled_model_path,
                                                      one_thread_per_rank) -> None:
    _write_checkpoint(tmp_path, arch)
    copy_tokenizer(bundled_model_path, tmp_path)
    one = _tokens(tmp_path, arch, 1)
    assert len(one) == 2 and len({t for tokens in one.values() for t in tokens}) > 3  # not a degenerate model
    assert _tokens(tmp_path, arch, 2) == one
