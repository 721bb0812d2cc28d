"""The bundled SmolLM2-135M (9 query heads, 3 KV heads, a tied 49,152-row vocabulary) split over
3 gloo ranks decodes greedily as one engine does, through the offline ``LLM`` API."""

from __future__ import annotations

from kvscale.server.entrypoints.llm import LLM
from kvscale.server.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def _tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, params)]


def test_three_ranks_decode_as_one(one_thread_per_rank) -> None:
    settings = dict(dtype="float32", device="cpu", num_gpu_blocks_override=64, max_num_batched_tokens=64)
    one = _tokens(LLM(**settings))
    llm = LLM(**settings, tensor_parallel_size=3)
    try:
        assert llm.llm_engine.runner.model.spec.num_heads == 3  # a third of the heads here
        assert _tokens(llm) == one
    finally:
        llm.llm_engine.runner.close()  # type: ignore[attr-defined]
