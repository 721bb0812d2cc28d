"""The vLLM-shaped offline API on the bundled model, and the `kvscale generate` command."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvscale import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(bundled_model_path):
    llm = LLM(dtype="float32", num_gpu_blocks_override=256, device="cpu")
    yield llm
    pool = llm.llm_engine.pool
    assert pool.num_active_blocks == 0 and not llm.llm_engine.has_unfinished_requests()


def test_generate_strings_and_token_ids(llm, greedy_prompts, hf_greedy_tokens, bundled_tokenizer):
    params = SamplingParams(temperature=0.0, max_tokens=16)
    prompts = [greedy_prompts[0], {"prompt_token_ids": bundled_tokenizer.encode(greedy_prompts[1])}]
    outputs = llm.generate(prompts, params)
    assert [o.prompt for o in outputs] == [greedy_prompts[0], None]
    for output, prompt in zip(outputs, greedy_prompts[:2], strict=True):
        assert output.prompt_token_ids == bundled_tokenizer.encode(prompt)
        completion = output.outputs[0]
        assert completion.token_ids == hf_greedy_tokens[prompt]
        assert completion.text == bundled_tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.finish_reason in ("stop", "length")
    single = llm.generate(greedy_prompts[0], params)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_generate_per_prompt_params_keep_order(llm):
    outputs = llm.generate(
        ["a", "b", "c"],
        [SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True),
         SamplingParams(max_tokens=3, ignore_eos=True, n=2, seed=3)],
    )
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 5, 3]
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * 3
    assert len(outputs[2].outputs) == 2
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_bad_prompt_aborts_the_whole_call(llm):
    with pytest.raises(ValueError, match="The prompt is empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.pool.num_active_blocks == 0


def test_chat_applies_template(llm, bundled_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    output = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=20))[0]
    expected = bundled_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert output.prompt_token_ids == bundled_tokenizer.encode(expected, add_special_tokens=False)
    assert "Paris" in output.outputs[0].text


@pytest.mark.slow
def test_cli_generate(bundled_model_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "kvscale", "generate", "The capital of France is", "--max-tokens", "5"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("The capital of France is") and "Paris" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "kvscale", "generate", "x", "--model", "/nonexistent"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert bad.returncode == 2 and "not a model directory" in bad.stderr
