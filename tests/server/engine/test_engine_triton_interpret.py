"""The whole engine with its GPU attention path (the Triton kernels) matches transformers greedily.

The kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1`` with
``KVSCALE_FORCE_TRITON=1``), so what the kernel unit tests do not cover is exercised here: the
runner's slot mapping, block tables, context lengths, chunked-prefill offsets and prefix-cache
hits, as the kernels receive them from the engine. The engine runs in a child process (this file,
run as a script): Triton decides between compiling and interpreting when a kernel is decorated,
so the variable must be set before anything imports it. In the child the CPU backends' ops are
replaced by functions that fail and the Triton backend's are counted, so every KV write and
attention provably went through Triton.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

NEW_TOKENS = 16
# The bundled model's 30 layers make each interpreted step slow: 6 tokens take its 14-token
# prompt's decode across a 16-token block boundary, which is what the real shapes add here.
BUNDLED_NEW_TOKENS = 6


def run_engine_interpreted(spec: dict) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", KVSCALE_FORCE_TRITON="1", CUDA_VISIBLE_DEVICES="",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), json.dumps(spec)],
        env=env, capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, f"child failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_went_through_triton(result: dict) -> None:
    calls = result["triton_calls"]
    assert calls["write_kv"] > 0 and calls["paged_prefill_attention"] > 0 and calls["paged_decode_attention"] > 0, calls
    # Multi-token chunks reached the prefill kernel with their length from the host, and mixed
    # batches were split so that their single-token sequences went to the decode kernel.
    assert result["max_query_len_seen"] > 1
    assert result["split_steps"] > 0


@pytest.mark.slow
def test_tiny_llama_triton_interpreted_matches_transformers(tmp_path, bundled_tokenizer):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    vocab = 512
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    hf_model = AutoModelForCausalLM.from_config(config).eval()
    hf_model.save_pretrained(str(tmp_path))
    bundled_tokenizer.save_pretrained(str(tmp_path))
    gen = torch.Generator().manual_seed(1)
    # The third prompt repeats the second's first 16 tokens: a prefix-cache hit (2 blocks of 8).
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 21, 40)]
    prompts.append(prompts[1][:16] + prompts[0])
    result = run_engine_interpreted({
        "model": str(tmp_path), "prompts": prompts, "new_tokens": NEW_TOKENS,
        "engine": {"block_size": 8, "num_gpu_blocks_override": 64, "max_num_batched_tokens": 24},
        "stagger": True,
    })
    assert_went_through_triton(result)
    assert result["prefix_cache_hits"] > 0
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            assert result["tokens"][str(i)] == ref[0, len(prompt):].tolist(), f"prompt {i}"


@pytest.mark.slow
def test_bundled_model_triton_interpreted_matches_transformers(
    bundled_model_path, bundled_tokenizer, greedy_prompts, hf_greedy_tokens
):
    prompts = [greedy_prompts[0], greedy_prompts[3]]
    result = run_engine_interpreted({
        "model": str(bundled_model_path), "prompts": [bundled_tokenizer.encode(p) for p in prompts],
        "new_tokens": BUNDLED_NEW_TOKENS, "eos": True,
        "engine": {"block_size": 16, "num_gpu_blocks_override": 32, "max_num_batched_tokens": 12},
        "stagger": True,
    })
    assert_went_through_triton(result)
    for i, prompt in enumerate(prompts):
        assert result["tokens"][str(i)] == hf_greedy_tokens[prompt][:BUNDLED_NEW_TOKENS], f"prompt {i}"


def test_runner_passes_max_query_len_from_the_host(make_engine):
    """The prefill kernel's grid size comes from the scheduler's counts, not a device read-back."""
    engine = make_engine()
    from kvscale.server.sampling_params import SamplingParams

    engine.add_request("a", list(range(10, 47)), SamplingParams(max_tokens=2))
    engine.add_request("b", list(range(10, 15)), SamplingParams(max_tokens=2))
    scheduled = engine.scheduler.schedule().scheduled
    meta = engine.runner.prepare(scheduled)[2]
    assert meta.max_query_len == 37 and not meta.is_decode
    engine.abort_request("a")
    engine.abort_request("b")


# --- the child ---------------------------------------------------------------------------------


def _child(spec: dict) -> None:
    import collections
    import dataclasses

    from kvscale.kernels import cpu_native, reference, triton_kernels
    from kvscale.server.config import EngineConfig
    from kvscale.server.engine.llm_engine import LLMEngine
    from kvscale.server.sampling_params import SamplingParams

    assert os.environ.get("TRITON_INTERPRET") == "1"
    calls: collections.Counter = collections.Counter()
    max_query_len = [0]
    failing, counting = {}, {}
    for name in ("write_kv", "paged_decode_attention", "paged_prefill_attention"):
        def fail(*args, _name=name, **kwargs):
            raise AssertionError(f"CPU {_name} called: the Triton path was not taken")

        failing[name] = fail
        inner = getattr(triton_kernels.TRITON, name)

        def counted(*args, _name=name, _inner=inner, **kwargs):
            calls[_name] += 1
            if _name == "paged_prefill_attention":
                max_query_len[0] = max(max_query_len[0], kwargs.get("max_query_len") or 0)
            return _inner(*args, **kwargs)

        counting[name] = counted
    # The engine's runner picks its backend through kvscale.kernels.backend_for, which reads these.
    cpu_native.CPU = dataclasses.replace(cpu_native.CPU, **failing)
    reference.REFERENCE = dataclasses.replace(reference.REFERENCE, **failing)
    triton_kernels.TRITON = dataclasses.replace(triton_kernels.TRITON, **counting)

    engine = LLMEngine(EngineConfig(model=spec["model"], dtype="float32", device="cpu", **spec["engine"]))
    split_steps = [0]
    prepare = engine.runner.prepare

    def prepare_counting(scheduled, in_flight=None):
        inputs = prepare(scheduled, in_flight)
        split_steps[0] += inputs[2].split is not None
        return inputs

    engine.runner.prepare = prepare_counting
    params = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=not spec.get("eos"))
    finished: dict[str, list[int]] = {}
    pending = list(enumerate(spec["prompts"]))
    # Staggered arrivals: later prompts are prefilled (in chunks) while earlier ones decode.
    engine.add_request("0", pending.pop(0)[1], params)
    while engine.has_unfinished_requests() or pending:
        if pending and (not spec.get("stagger") or engine.num_generated_tokens >= 2 * (len(finished) + 1)):
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, params)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    print(json.dumps({
        "tokens": finished,
        "triton_calls": dict(calls),
        "max_query_len_seen": max_query_len[0],
        "split_steps": split_steps[0],
        "prefix_cache_hits": engine.get_stats().prefix_cache_hits,
    }))


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
