"""The families with layers of their own, and experts stacked as transformers holds them, split
over 2 gloo ranks: greedy tokens equal to one rank's and log-probabilities within float32's
rounding, on tiny random checkpoints transformers writes from its own configs.

- Gemma 3: local (8-token window over 8-token blocks) and global layers, four norms a layer with
  random weights, q/k norms, soft-capped logits; 4 query heads over 2 KV heads (one each).
- gpt-oss: random attention sinks (split with their query heads) and expert biases (the down
  projection's added once, by rank 0), a SwiGLU limit the projections reach, stacked experts cut
  along each one's intermediate dimension; 4 query heads over one KV head, which both ranks hold.
- Mixtral and Qwen3-MoE saved in transformers' stacked ``[experts, ...]`` form.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from greedy_runs import greedy_runs  # noqa: E402
from tiny_checkpoints import copy_tokenizer  # noqa: E402

VOCAB = 512
NEW_TOKENS = 8


def _config(arch: str):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                             layer_types=["sliding_attention", "full_attention",
                                                          "sliding_attention"],
                                             rope_local_base_freq=100.0, final_logit_softcapping=3.0)
    if arch == "gpt_oss":
        return transformers.GptOssConfig(
            **{**common, "num_key_value_heads": 1, "intermediate_size": 48}, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.0, attention_bias=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
    if arch == "mixtral-stacked":
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen3_moe-stacked":  # layer 1 a dense MLP among sparse ones
        return transformers.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True)
    raise ValueError(arch)


def _write_checkpoint(path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _config(arch)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Fresh norms, sinks and biases are constants (Gemma's norms zero, gpt-oss's biases
            # zero): random ones make each rank's slice of them matter.
            if name.endswith(("norm.weight", "sinks", "_bias", ".bias")):
                param.normal_(0, 0.5 if "bias" in name else 0.3)
    # The stacked form (save_original_format=False) for Mixtral and Qwen3-MoE; gpt-oss has no other.
    model.save_pretrained(str(path), save_original_format=not arch.endswith("-stacked"))


def _run(path: Path, size: int) -> dict[str, tuple[list[int], list[float]]]:
    return greedy_runs(path, size, VOCAB, NEW_TOKENS)


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss"])
def test_a_model_built_from_a_familys_spec_is_the_familys(arch) -> None:
    """A rank builds its shard as DecoderForCausalLM(spec) (tp_group.load_shard): the spec's
    family decides the class; copies keep it."""
    import copy

    from kvscale.server.worker.model_llama import DecoderForCausalLM
    from kvscale.server.worker.model_loader import model_spec

    config = _config(arch)
    with torch.device("meta"):
        model = DecoderForCausalLM(model_spec(config), config)
    assert type(model).__name__ == {"gemma3": "Gemma3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}[arch]
    assert type(copy.deepcopy(model)) is type(model)


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss", "mixtral-stacked", "qwen3_moe-stacked"])
def test_two_ranks_decode_each_family_as_one(arch, tmp_path, bundled_model_path, one_thread_per_rank) -> None:
    _write_checkpoint(tmp_path, arch)
    if arch.endswith("-stacked"):  # the form under test, not the hub's per-expert names
        from safetensors import safe_open

        with safe_open(str(next(tmp_path.glob("*.safetensors"))), framework="pt") as opened:
            assert "model.layers.0.mlp.experts.gate_up_proj" in opened.keys()
    copy_tokenizer(bundled_model_path, tmp_path)
    one = _run(tmp_path, 1)
    assert len(one) == 3 and len({t for tokens, _ in one.values() for t in tokens}) > 3  # not degenerate
    two = _run(tmp_path, 2)
    assert {rid: tokens for rid, (tokens, _) in two.items()} == {rid: tokens for rid, (tokens, _) in one.items()}
    for rid, (_, logprobs) in two.items():
        assert logprobs == pytest.approx(one[rid][1], abs=1e-4), rid
