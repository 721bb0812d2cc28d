"""Sliding-window layers free their KV blocks under tensor parallel too (docs/engine.md,
"Sliding-window layers' KV blocks"): rank 0's scheduler keeps both groups' pools, every rank both
groups' caches of its own heads. A tiny random Gemma 3 (an 8-token window over 4-token blocks)
over 2 gloo ranks generates four times its window with the same greedy tokens, log-probabilities
within float32's rounding and window-group block counts, step by step, as on one rank; through a
prefix-cache hit and a fork (n=2, copy-on-write in both groups' caches) too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvscale.server.config import EngineConfig
from kvscale.server.core.window_group import blocks_per_sequence
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_checkpoints import copy_tokenizer, tiny_window_gemma3  # noqa: E402

VOCAB, WINDOW, BLOCK = 512, 8, 4
NEW_TOKENS = 4 * WINDOW

Outputs = dict[str, list[tuple[list[int], list[float]]]]


def _write_checkpoint(path: Path) -> None:
    tiny_window_gemma3(VOCAB, WINDOW).save_pretrained(str(path))


def _step_all(engine: LLMEngine, held: list[int]) -> tuple[Outputs, dict[str, int]]:
    """Every request's samples (tokens, their log-probabilities) and cached prompt tokens; the
    window pool's held blocks after each step appended to ``held``."""
    outputs: Outputs = {}
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [
                    (list(o.token_ids), [step[t].logprob for t, step in zip(o.token_ids, o.logprobs, strict=True)])
                    for o in out.outputs]
                cached[out.request_id] = out.num_cached_tokens or 0
        assert engine.kv.window is not None
        held.append(engine.kv.window.pool.num_active_blocks)
    return outputs, cached


def _run(path: Path, size: int) -> tuple[Outputs, dict[str, int], list[int], list[int]]:
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", num_gpu_blocks_override=64,
                                    block_size=BLOCK, max_num_batched_tokens=16, tensor_parallel_size=size))
    try:
        # The two-group layout, not the one group that keeps every block.
        assert engine.kv.window is not None and engine.runner.groups is not None
        assert engine.runner.groups.window_layers == (0, 2)
        prompt = torch.randint(3, VOCAB, (21,), generator=torch.Generator().manual_seed(1)).tolist()

        def greedy(n: int = 1) -> SamplingParams:
            return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, n=n)

        alone: list[int] = []
        engine.add_request("alone", prompt, greedy())
        outputs, cached = _step_all(engine, alone)
        assert engine.pool.num_active_blocks == 0 and engine.kv.window.pool.num_active_blocks == 0
        # A prefix-cache hit (its window blocks revived from the pool's cached free ones) and two
        # samples forked from one prefill, each writing its own copy of the shared partial block.
        again: list[int] = []
        engine.add_request("again", prompt, greedy())
        engine.add_request("forked", prompt[:13], greedy(2))
        more, more_cached = _step_all(engine, again)
        return outputs | more, cached | more_cached, alone, again
    finally:
        if size > 1:
            engine.runner.close()  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, bundled_model_path) -> Path:
    path = tmp_path_factory.mktemp("gemma3-window-tp")
    _write_checkpoint(path)
    copy_tokenizer(bundled_model_path, path)
    return path


def test_two_ranks_free_window_blocks_as_one(gemma3, one_thread_per_rank) -> None:
    one, one_cached, one_alone, one_again = _run(gemma3, 1)
    two, two_cached, two_alone, two_again = _run(gemma3, 2)
    assert len({t for samples in one.values() for tokens, _ in samples for t in tokens}) > 8  # not degenerate
    assert {rid: [tokens for tokens, _ in samples] for rid, samples in two.items()} == \
        {rid: [tokens for tokens, _ in samples] for rid, samples in one.items()}
    for rid, samples in two.items():
        for (_, logprobs), (_, expected) in zip(samples, one[rid], strict=True):
            assert logprobs == pytest.approx(expected, abs=1e-4), rid
    assert two_cached["again"] > 0 and two_cached == one_cached
    # The window group's blocks: the same count after every step as on one rank, and bounded by
    # the window and a 16-token chunk however long the sequence (one with every block kept would
    # reach 14 for the 53-token sequence).
    assert two_alone == one_alone and two_again == one_again
    assert max(two_alone) <= blocks_per_sequence(WINDOW, BLOCK, 16)
    assert two_alone[-2] <= blocks_per_sequence(WINDOW, BLOCK)  # the last decode step
    assert max(two_again) <= 3 * blocks_per_sequence(WINDOW, BLOCK, 16)
