"""Accuracy of every precision the engine runs, judged one way: teacher-forced log-probabilities
of a fixed text under kvscale's engine against transformers in float32 on the same checkpoint.

The figure is the perplexity ratio (engine ÷ transformers) over a few hundred tokens; float32
must match to rounding (its greedy tokens equal transformers': test_engine_greedy.py), bfloat16
stay within 1 %, int8 weights within 3 % (5 % in bfloat16: BOUNDS says why). Each check also
bounds the worst single-token difference, so a layout bug that happens to average out still fails.

CPU-dependent: int8 runs on oneDNN's int8 GEMM where the CPU has VNNI or AMX and on codes widened
to float32 elsewhere, and the C kernels take AVX-512 or AVX2 loops; bfloat16's figures differ
between those paths by rounding, within the bounds (measured on both paths: BOUNDS).

An FP8 KV cache (--kv-cache-dtype) is judged the same way against the same float32 reference:
every prompt position attends to K/V read back from the cache, so the whole text sees FP8's
rounding (3 mantissa bits for e4m3, 2 for e5m2, scales 1.0 as vLLM's default).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvscale.server.sampling_params import SamplingParams

# Plain English prose, fixed here so the figure never drifts with a file elsewhere.
TEXT = (
    "The river that runs through the old town was once the reason the town existed at all. Boats "
    "carried grain and timber down to the coast, and the merchants who grew rich on that trade built "
    "the stone houses that still line the eastern bank. When the railway arrived in the last years of "
    "the century, the boats became fewer every season, and by the time the bridge was rebuilt the "
    "wharves had turned into gardens. Today the river is quiet. Children learn to swim in the shallow "
    "bend below the mill, fishermen wait for trout in the early morning, and in summer the town holds "
    "a festival on the water with music, lanterns and a race between rowing teams from the nearby "
    "villages. Visitors often ask why the houses on the western bank are so much smaller. The answer "
    "is that the western bank floods. For hundreds of years the people who could afford to build "
    "there chose not to, and the land was left to farmers, who rebuilt their cottages after every "
    "great flood. A wall was finally raised in the middle of the last century, and since then the "
    "water has never crossed it, but the small houses remain, painted in bright colours, and many of "
    "them now belong to artists who say that the light on that side of the river is the best in the "
    "whole valley. In the evening, when the sun sets behind the hills, the stone of the eastern houses "
    "turns gold and the reflections stretch across the water to the painted cottages opposite."
)
NUM_TOKENS = 280

# (dtype, quantization) -> the largest allowed |perplexity ratio - 1| and worst token difference
# (nats). int8 in bfloat16 is the noisy one: its token log-probabilities move by 0.35 nats (standard
# deviation over the text) with any rounding-level change, so its ratio over 279 tokens moves by
# about 2 %. Measured on this text, all the same model: 1.033 prefill and 1.025 in 32-token steps on
# a Zen 5 EPYC (AVX-512 VNNI: oneDNN's int8 GEMM); 1.039 with that GEMM writing float32; 1.036 with
# PyTorch's element-wise ops; 1.027 and 1.015 emulating an AVX2 EPYC (the C kernels built for
# znver2, torch and oneDNN held to AVX2, the codes widened to float32). Hence 5 %, which a broken
# scale still fails by far (one activation scale per step instead of per token: 2.04). A lost
# smoothing does not show through that noise in bfloat16 (1.040) but does in float32, whose 3 % it
# fails (1.038 against 0.998): the float32 row is the one that guards the int8 recipe.
BOUNDS = {
    ("float32", None): (1e-4, 1e-3),
    ("bfloat16", None): (0.01, 0.5),
    ("float32", "int8"): (0.03, 2.0),
    ("bfloat16", "int8"): (0.05, 2.0),
}


# (dtype, quantization, kv_cache_dtype) -> bounds as above: int8 weights' 3 % for an FP8 cache alone
# (measured on this text: e4m3 1.003 with bfloat16 weights, 1.007 with float32; e5m2, one mantissa
# bit fewer, 1.009). With int8 weights in bfloat16 as well, the noise above and the cache's rounding
# together: 1.028 to 1.032 on the Zen 5 EPYC's paths, 1.041 and 1.045 emulating the AVX2 EPYC, so
# 7 %; the worst token there was 1.2 to 1.3 nats on every path but one (2.21, a single token: the next
# was 1.2), so 2.5.
KV_BOUNDS = {
    ("bfloat16", None, "fp8_e4m3"): (0.03, 2.0),
    ("bfloat16", None, "fp8_e5m2"): (0.03, 2.0),
    ("float32", None, "fp8_e4m3"): (0.03, 2.0),
    ("bfloat16", "int8", "fp8_e4m3"): (0.07, 2.5),
}


@pytest.fixture(scope="module")
def text_ids(bundled_tokenizer) -> list[int]:
    ids = bundled_tokenizer.encode(TEXT)
    assert len(ids) >= NUM_TOKENS, f"the fixed text is only {len(ids)} tokens"
    return ids[:NUM_TOKENS]


@pytest.fixture(scope="module")
def reference_logprobs(hf_bundled_model, text_ids) -> list[float]:
    """transformers float32: log p(token i | tokens < i) for i = 1 .. n - 1."""
    with torch.inference_mode():
        logits = hf_bundled_model(torch.tensor([text_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[i - 1, token].item() for i, token in enumerate(text_ids) if i > 0]


def engine_logprobs(engine, run_to_completion, text_ids: list[int]) -> list[float]:
    engine.add_request("text", list(text_ids), SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    output = run_to_completion(engine)["text"]
    return [position[token].logprob for position, token in zip(output.prompt_logprobs[1:], text_ids[1:], strict=True)]


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def check_against_reference(ours: list[float], reference: list[float], bounds: tuple[float, float], label: str) -> None:
    ratio = perplexity(ours) / perplexity(reference)
    worst = max(abs(a - b) for a, b in zip(ours, reference, strict=True))
    print(f"{label}: perplexity ratio {ratio:.5f}, worst token {worst:.4f} nats")
    ratio_bound, worst_bound = bounds
    assert abs(ratio - 1) <= ratio_bound, f"perplexity ratio {ratio:.5f} (bound 1 ± {ratio_bound})"
    assert worst <= worst_bound, f"a token's log-probability differs by {worst:.4f} nats (bound {worst_bound})"


@pytest.mark.parametrize(("dtype", "quantization"), list(BOUNDS), ids=lambda v: str(v))
def test_perplexity_ratio_against_transformers_float32(
    make_engine, run_to_completion, text_ids, reference_logprobs, dtype, quantization
):
    overrides = {"dtype": dtype, "num_gpu_blocks_override": 64}
    if quantization is not None:
        overrides["quantization"] = quantization
    ours = engine_logprobs(make_engine(**overrides), run_to_completion, text_ids)
    check_against_reference(ours, reference_logprobs, BOUNDS[(dtype, quantization)], f"{dtype} {quantization}")


@pytest.mark.parametrize(("dtype", "quantization", "kv_cache_dtype"), list(KV_BOUNDS), ids=lambda v: str(v))
def test_perplexity_ratio_with_an_fp8_kv_cache(
    make_engine, run_to_completion, text_ids, reference_logprobs, dtype, quantization, kv_cache_dtype
):
    engine = make_engine(dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                         num_gpu_blocks_override=64)
    assert engine.runner.kv_cache.element_size() == 1
    ours = engine_logprobs(engine, run_to_completion, text_ids)
    check_against_reference(ours, reference_logprobs, KV_BOUNDS[(dtype, quantization, kv_cache_dtype)],
                            f"{dtype} {quantization} KV {kv_cache_dtype}")


@pytest.mark.parametrize(("dtype", "quantization"), [("bfloat16", None), ("bfloat16", "int8"), ("float32", "int8")],
                         ids=lambda v: str(v))
def test_perplexity_ratio_in_decode_sized_steps(
    make_engine, run_to_completion, text_ids, reference_logprobs, dtype, quantization
):
    """The text computed 32 tokens a step: every projection runs on as many rows as a batched
    decode step has, where the CPU's AMX kernels take over from oneDNN (server/worker/cpu_linear.py), so
    those paths answer to the same bounds as prefill's."""
    engine = make_engine(dtype=dtype, quantization=quantization, num_gpu_blocks_override=64,
                         max_num_batched_tokens=32, max_num_seqs=32)
    ours = engine_logprobs(engine, run_to_completion, text_ids)
    check_against_reference(ours, reference_logprobs, BOUNDS[(dtype, quantization)],
                            f"{dtype} {quantization} in 32-token steps")
