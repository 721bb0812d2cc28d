"""The host KV tier (--kv-offloading-size) under tensor parallel (server/worker/tp_messages.py):
every rank allocates its own host slots and runs rank 0's copies between the tiers on its own
heads. On test_tensor_parallel.py's tiny random Llama at TP 2 (one KV head a rank), a prompt's
prefix is pushed from a 16-block pool down to the host tier by a longer prompt, then restored
for the prompt's return: its greedy tokens and logprobs equal TP 1's with the same tier and a
TP 1 engine's without one, which recomputes the prefix. A rank that skipped a restore would
attend over another prompt's keys in the restored blocks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_checkpoints import write_tiny_tp_llama  # noqa: E402

from kvscale.server.config import EngineConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.sampling_params import SamplingParams

VOCAB = 500
BLOCK = 8
POOL_BLOCKS = 16  # 128 tokens: the long prompt takes every block
HOST_SLOTS = 12  # room for the first prompt's prefix


def host_gib(kv_heads: int) -> float:
    """--kv-offloading-size for HOST_SLOTS blocks of the whole model's heads (16 wide, 2 layers,
    K|V, float32): at TP N the total is split, 1/N a rank, and each rank's block is 1/N as large
    where the ranks divide the KV heads, so the slots are as many at any N."""
    return HOST_SLOTS * kv_heads * 16 * 2 * 2 * 4 * BLOCK / 2**30


HOST_GIB = host_gib(kv_heads=2)


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


FIRST = _tokens(1, 40)  # 5 full blocks
LONG = _tokens(2, 120)  # with its 4 new tokens, all 16 blocks: FIRST's go down to the host tier
AGAIN = FIRST + _tokens(3, 8)  # FIRST's 5 blocks restored, 8 tokens computed


@pytest.fixture(scope="module")
def tiny_llama(bundled_model_path, tmp_path_factory) -> Path:
    return write_tiny_tp_llama(bundled_model_path, tmp_path_factory.mktemp("tiny-llama-tp-tier"), VOCAB)


def tier_engine(path: Path, size: int, host_gib: float, **nodes: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", num_gpu_blocks_override=POOL_BLOCKS,
                                  block_size=BLOCK, max_num_batched_tokens=64, tensor_parallel_size=size,
                                  kv_offloading_size=host_gib, **nodes))  # type: ignore[arg-type]


def evict_and_restore(engine: LLMEngine, run_to_completion) -> dict[str, tuple[list[int], list[float]]]:
    """FIRST, then LONG (which pushes FIRST's blocks out of the pool), then AGAIN: each request's
    greedy tokens and their logprobs."""
    got = {}
    for rid, prompt in (("first", FIRST), ("long", LONG), ("again", AGAIN)):
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=1, ignore_eos=True))
        out = run_to_completion(engine)[rid].outputs[0]
        tokens = list(out.token_ids)
        got[rid] = (tokens, [step[t].logprob for step, t in zip(out.logprobs, tokens, strict=True)])
    return got


def assert_same(got: dict, want: dict) -> None:
    assert {rid: tokens for rid, (tokens, _) in got.items()} == {rid: tokens for rid, (tokens, _) in want.items()}
    for rid, (_, logprobs) in want.items():
        assert got[rid][1] == pytest.approx(logprobs, abs=1e-4), rid


def assert_restored(engine: LLMEngine) -> None:
    """AGAIN's prefix came back from the host tier: its 5 blocks promoted, its 40 tokens hits."""
    assert engine.pool.host is not None and engine.pool.host.num_slots == HOST_SLOTS
    assert engine.pool.num_demoted >= 5 and engine.pool.num_promoted >= 5
    extra = engine.get_stats().extra
    assert extra["external_prefix_cache_hits_total"] >= 40 and extra["kv_blocks_promoted_total"] >= 5
    assert engine.runner.host_cache is not None
    assert extra["kv_offload_bytes_cpu_to_gpu"] >= 5 * engine.runner.host_cache.block_bytes


@pytest.fixture(scope="module")
def one_rank(tiny_llama, run_to_completion) -> dict[str, tuple[list[int], list[float]]]:
    """TP 1 with the tier, checked against TP 1 recomputing the prefix (no tier)."""
    tiered = tier_engine(tiny_llama, 1, HOST_GIB)
    got = evict_and_restore(tiered, run_to_completion)
    assert_restored(tiered)
    flat = tier_engine(tiny_llama, 1, 0.0)
    recomputed = evict_and_restore(flat, run_to_completion)
    assert flat.pool.num_promoted == 0 and flat.get_stats().prefix_cache_hits < 40
    assert_same(got, recomputed)
    assert len(set(got["again"][0] + got["long"][0])) > 2  # not a degenerate model
    return got


def test_two_ranks_restore_a_prefix_from_the_host_tier_as_one(tiny_llama, one_rank, one_thread_per_rank,
                                                              run_to_completion) -> None:
    engine = tier_engine(tiny_llama, 2, HOST_GIB)
    try:
        # Rank 0's block: the heads of one of the two KV heads, so the tier's slots are as many as at TP 1.
        assert engine.runner.host_cache is not None and engine.runner.host_cache.block_bytes == 2 * 16 * 2 * 4 * BLOCK
        assert_same(evict_and_restore(engine, run_to_completion), one_rank)
        assert_restored(engine)
    finally:
        engine.runner.close()  # type: ignore[attr-defined]
