"""Sliding-window layers free the KV blocks that fall out of their window (server/core/window_group.py,
server/worker/kv_groups.py): a tiny random Gemma 3 generates four times its window with its window
group's blocks bounded, its greedy tokens still transformers' in float32, through a prefix-cache hit
and a fork (n=2) too."""

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
from tiny_checkpoints import tiny_window_gemma3  # noqa: E402

VOCAB, WINDOW, BLOCK = 512, 8, 4
NEW_TOKENS = 4 * WINDOW


@pytest.fixture(scope="module")
def gemma3(bundled_tokenizer, tmp_path_factory):
    model = tiny_window_gemma3(VOCAB, WINDOW)
    path = tmp_path_factory.mktemp("gemma3-window")
    model.save_pretrained(str(path))
    bundled_tokenizer.save_pretrained(str(path))
    return path, model


def _reference(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _run(engine: LLMEngine, most_window_blocks: list[int]) -> dict:
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        most_window_blocks.append(engine.kv.window.pool.num_active_blocks)
    return outputs


def test_window_blocks_stay_bounded_and_tokens_match_transformers(gemma3) -> None:
    path, model = gemma3
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", num_gpu_blocks_override=64,
                                    block_size=BLOCK, max_num_batched_tokens=16))
    assert engine.kv.window is not None and engine.runner.groups is not None
    assert engine.runner.groups.window_layers == (0, 2)
    prompt = torch.randint(3, VOCAB, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = _reference(model, prompt)
    assert len(set(expected)) > WINDOW  # a model that repeats one token would prove little
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

    held: list[int] = []
    engine.add_request("alone", prompt, greedy)
    assert _run(engine, held)["alone"].outputs[0].token_ids == expected
    # One sequence of 53 tokens: the full group held 14 blocks at the end, the window group never
    # more than the window and a 16-token chunk span.
    assert max(held) <= blocks_per_sequence(WINDOW, BLOCK, 16)
    assert held[-2] <= blocks_per_sequence(WINDOW, BLOCK)  # the last decode step
    assert engine.pool.num_active_blocks == 0 and engine.kv.window.pool.num_active_blocks == 0

    # Again: a prefix-cache hit, its window blocks revived from the pool's cached-free ones; then
    # two samples forked from one prefill, each writing its own copy of the shared partial block.
    held.clear()
    engine.add_request("again", prompt, greedy)
    engine.add_request("forked", prompt[:13], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                             n=2))
    outputs = _run(engine, held)
    assert outputs["again"].num_cached_tokens > 0
    assert outputs["again"].outputs[0].token_ids == expected
    forked = _reference(model, prompt[:13])
    assert [o.token_ids for o in outputs["forked"].outputs] == [forked, forked]
    assert max(held) <= 3 * blocks_per_sequence(WINDOW, BLOCK, 16)


def test_window_group_kept_off_where_it_is_not_built() -> None:
    from types import SimpleNamespace

    from kvscale.server.engine.engine_build import window_group_of

    spec = SimpleNamespace(layer_windows=(8, None, 8))
    assert window_group_of(EngineConfig(), spec) is not None
    assert window_group_of(EngineConfig(tensor_parallel_size=2), spec) is not None  # test_tensor_parallel_window.py
    assert window_group_of(EngineConfig(kv_offloading_size=1.0), spec) is None
    assert window_group_of(EngineConfig(), SimpleNamespace()) is None  # a model without per-layer windows
