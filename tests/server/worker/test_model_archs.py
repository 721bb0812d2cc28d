"""kvscale's own model code for each supported architecture against transformers, on tiny
random-weight checkpoints written to disk and loaded back through the engine. The prompts'
chunks and decodes share steps (``max_num_batched_tokens`` 24), so a mixture-of-experts layer
routes prefill and decode rows in one batch."""

from __future__ import annotations

import pytest
import torch

from kvscale.server.config import EngineConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.sampling_params import SamplingParams

VOCAB = 512
NEW_TOKENS = 10


def tiny_config(arch: str):
    import transformers

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "llama-mha-bias":  # TinyLlama-style shapes plus attention bias
        return transformers.LlamaConfig(**{**common, "num_key_value_heads": 4}, attention_bias=True, mlp_bias=True)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None, head_dim=16)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if arch in ("mixtral", "mixtral-stacked"):
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if arch == "qwen3_moe-dense-layer":  # layer 1 a dense MLP; the top-2 weights renormalized
        return transformers.Qwen3MoeConfig(**common, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=True)
    if arch == "phi3":
        return transformers.Phi3Config(**common)
    if arch == "phi3-partial-longrope":  # Phi-4-mini's shape of RoPE: a quarter of each head passes through
        factors = [1.0 + 0.25 * i for i in range(6)]  # 16 * 0.75 / 2 per list
        return transformers.Phi3Config(**{**common, "max_position_embeddings": 512}, partial_rotary_factor=0.75,
                                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.75, "short_factor": factors,
                                                        "long_factor": [f * 3 for f in factors]},
                                       original_max_position_embeddings=128)
    if arch == "gemma3":
        # A window of 8 tokens over blocks of 8 (the test's block_size): every window crosses a
        # block boundary, and the longer prompts run far past it.
        return transformers.Gemma3TextConfig(**{**common, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                             rope_local_base_freq=100.0, final_logit_softcapping=3.0)
    if arch == "gemma3-pattern":  # an older config: every second layer global, no soft-capping
        return transformers.Gemma3TextConfig(**{**common, "num_hidden_layers": 4}, head_dim=16, sliding_window=6,
                                             sliding_window_pattern=2)
    if arch == "gpt_oss":
        # Local, full, local layers (the default pattern); a window of 8 over blocks of 8 as Gemma 3's;
        # YaRN as the hub's checkpoints have it, scaled to this length; a SwiGLU limit the
        # random projections reach, so both clamps bite.
        return transformers.GptOssConfig(
            **{**common, "num_hidden_layers": 3, "intermediate_size": 48}, head_dim=16, num_local_experts=8,
            num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.0,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
    raise ValueError(arch)


@pytest.fixture(scope="module")
def tokenizer_files(bundled_tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    bundled_tokenizer.save_pretrained(str(path))
    return path


@pytest.mark.parametrize("arch", ["llama", "llama-mha-bias", "mistral", "qwen2", "qwen3", "mixtral",
                                  "mixtral-stacked", "qwen3_moe", "qwen3_moe-dense-layer", "phi3",
                                  "phi3-partial-longrope", "gemma3", "gemma3-pattern", "gpt_oss"])
def test_tiny_model_matches_transformers(arch, tmp_path, tokenizer_files, run_to_completion):
    import shutil

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(arch)
    hf_model = AutoModelForCausalLM.from_config(config).eval()
    if config.model_type == "qwen2" or getattr(config, "attention_bias", False):
        with torch.no_grad():  # random biases: freshly initialised ones are zero
            for layer in hf_model.model.layers:
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                    if proj.bias is not None:
                        proj.bias.normal_(0, 0.5)
                if getattr(getattr(layer.mlp, "down_proj", None), "bias", None) is not None:
                    layer.mlp.down_proj.bias.normal_(0, 0.5)
    if config.model_type == "gpt_oss":
        with torch.no_grad():  # random sinks and expert biases: fresh expert biases are zero
            for layer in hf_model.model.layers:
                layer.self_attn.sinks.normal_(0, 1.0)
                layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.5)
                layer.mlp.experts.down_proj_bias.normal_(0, 0.5)
    if config.model_type == "gemma3_text":
        with torch.no_grad():  # random norms: each scales by 1 + weight, and fresh weights are zero
            for name, param in hf_model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0, 0.3)
    # "-stacked": the experts as transformers holds them ([experts, ...] tensors), not the hub's names.
    hf_model.save_pretrained(str(tmp_path), save_original_format=not arch.endswith("-stacked"))
    for file in tokenizer_files.iterdir():
        shutil.copy(file, tmp_path / file.name)

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu",
                                    num_gpu_blocks_override=64, block_size=8, max_num_batched_tokens=24))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                          ignore_eos=True, logprobs=1))
    outputs = run_to_completion(engine)
    assert engine.pool.num_active_blocks == 0

    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True, pad_token_id=0)
            ref_tokens = ref.sequences[0, len(prompt):].tolist()
            got = outputs[str(i)].outputs[0]
            assert got.token_ids == ref_tokens, f"{arch} prompt {i}"
            for step, (token, position) in enumerate(zip(got.token_ids, got.logprobs, strict=True)):
                expected = torch.log_softmax(ref.logits[step][0].float(), dim=-1)[token]
                assert abs(position[token].logprob - float(expected)) < 1e-4, (arch, i, step)

