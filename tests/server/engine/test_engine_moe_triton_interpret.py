"""The whole engine on a mixture-of-experts model with its GPU path (the Triton kernels, the fused
MoE kernel among them) matches transformers greedily, in Triton's interpreter on the CPU.

The child is test_engine_triton_interpret.py's (its CPU ops replaced by failing ones, the Triton
backend's counted), run from this file so that the fused MoE kernel's launcher is counted too:
every sparse layer of every step provably went through kernels/moe_triton.py. The model's
projections keep their ``nn.Linear`` weights, as on a GPU (the CPU's layouts are left out).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

NEW_TOKENS = 8
VOCAB = 512


@pytest.mark.slow
def test_tiny_qwen3_moe_triton_interpreted_matches_transformers(tmp_path, bundled_tokenizer):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=True,
    )
    hf_model = AutoModelForCausalLM.from_config(config).eval()
    hf_model.save_pretrained(str(tmp_path))
    bundled_tokenizer.save_pretrained(str(tmp_path))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 19)]
    spec = {"model": str(tmp_path), "prompts": prompts, "new_tokens": NEW_TOKENS,
            "engine": {"block_size": 8, "num_gpu_blocks_override": 32, "max_num_batched_tokens": 16},
            "stagger": True}
    env = dict(os.environ, TRITON_INTERPRET="1", KVSCALE_FORCE_TRITON="1", CUDA_VISIBLE_DEVICES="",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), json.dumps(spec)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    lines = proc.stdout.strip().splitlines()
    result, moe = json.loads(lines[-2]), json.loads(lines[-1])
    assert result["triton_calls"]["paged_decode_attention"] > 0 and result["triton_calls"]["write_kv"] > 0
    # Both layers sparse, every forward through the kernel: at least one step per new token.
    assert moe["moe_kernel_calls"] >= 2 * NEW_TOKENS and moe["moe_kernel_declined"] == 0, moe
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            assert result["tokens"][str(i)] == ref[0, len(prompt):].tolist(), f"prompt {i}"


def _child(spec: dict) -> None:
    from kvscale.kernels import moe_triton
    from kvscale.server.worker import model_llama

    # The model as a GPU holds it: the CPU's weight layouts (server/worker/cpu_linear.py) replace
    # the experts' nn.Linear weights, which the kernel reads, on a CPU device only.
    model_llama.lay_out_cpu_linears = lambda model: None

    calls = {"moe_kernel_calls": 0, "moe_kernel_declined": 0}
    launch = moe_triton.fused_moe

    def counted(*args, **kwargs):
        out = launch(*args, **kwargs)
        calls["moe_kernel_calls" if out is not None else "moe_kernel_declined"] += 1
        return out

    moe_triton.fused_moe = counted
    path = Path(__file__).with_name("test_engine_triton_interpret.py")
    module_spec = importlib.util.spec_from_file_location("engine_triton_interpret_child", path)
    assert module_spec is not None and module_spec.loader is not None
    engine_child = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(engine_child)
    engine_child._child(spec)  # prints its JSON line
    print(json.dumps(calls))


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
