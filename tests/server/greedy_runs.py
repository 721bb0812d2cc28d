"""Greedy runs of a tiny checkpoint through the engine, for the tests comparing one tensor-parallel
size (or one loading path) with another: each request's tokens and their log-probabilities."""

from __future__ import annotations

from pathlib import Path

import torch

from kvscale.server.config import EngineConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.sampling_params import SamplingParams

PROMPT_LENGTHS = (5, 19, 40)


def greedy_runs(path: Path, ranks: int, vocab: int, new_tokens: int) -> dict[str, tuple[list[int], list[float]]]:
    """Three random prompts (ids below ``vocab``, the same every call) decoded greedily over
    ``ranks`` CPU ranks, their chunks and decodes sharing steps; every block freed at the end."""
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", num_gpu_blocks_override=64,
                                    block_size=8, max_num_batched_tokens=24, tensor_parallel_size=ranks))
    gen = torch.Generator().manual_seed(1)
    try:
        for i, n in enumerate(PROMPT_LENGTHS):
            engine.add_request(str(i), torch.randint(3, vocab, (n,), generator=gen).tolist(),
                               SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=0))
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    got = out.outputs[0]
                    finished[out.request_id] = (list(got.token_ids), [step[t].logprob for t, step in
                                                                      zip(got.token_ids, got.logprobs, strict=True)])
        assert engine.pool.num_active_blocks == 0
        return finished
    finally:
        if ranks > 1:
            engine.runner.close()  # type: ignore[attr-defined]
