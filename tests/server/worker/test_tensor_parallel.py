"""Tensor parallel (server/worker/tp_shard.py, tp_layers.py, tp_group.py): the shard decisions
alone, then engines of 2 and 3 gloo ranks (processes) on a tiny random-weight Llama greedy-equal
to the same engine on one, prefix caching on; a rank killed under a request in flight fails the
next step with an error naming it.

The checkpoint has 6 query heads and 2 KV heads, so 3 ranks each need KV heads their neighbours
also read (replication), and a vocabulary of 500 rows, which 3 ranks split with padding.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_checkpoints import write_tiny_tp_llama  # noqa: E402

from kvscale.server.config import EngineConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.model_llama import DecoderSpec
from kvscale.server.worker.moe import MoeSpec
from kvscale.server.worker.tp_group import RankFailed
from kvscale.server.worker.tp_shard import (
    ShardPlan,
    local_kv_heads,
    tensor_parallel_refusal,
    vocab_shard,
)

VOCAB = 500
NEW_TOKENS = 8


# --- the decisions ---------------------------------------------------------------------------

def test_kv_heads_split_when_the_ranks_divide_them() -> None:
    assert [local_kv_heads(8, 4, 2, r) for r in range(2)] == [[0, 1], [2, 3]]
    assert [local_kv_heads(9, 3, 3, r) for r in range(3)] == [[0], [1], [2]]  # SmolLM2-135M at TP 3


def test_kv_heads_replicated_where_ranks_outnumber_them() -> None:
    assert [local_kv_heads(8, 2, 4, r) for r in range(4)] == [[0], [0], [1], [1]]
    # 6 query heads in 2 groups of 3 over 3 ranks: rank 1's two heads read different KV heads,
    # so every rank holds two (repeating its one where both its heads read it).
    assert [local_kv_heads(6, 2, 3, r) for r in range(3)] == [[0, 0], [0, 1], [1, 1]]


def test_every_query_head_reads_its_own_kv_head_on_its_rank() -> None:
    for heads, kv, size in [(6, 2, 3), (12, 4, 6), (8, 8, 4), (32, 8, 16), (10, 5, 2)]:
        for rank in range(size):
            local = local_kv_heads(heads, kv, size, rank)
            per_rank = heads // size
            share = per_rank // len(local)
            for q in range(per_rank):
                assert local[q // share] == (rank * per_rank + q) // (heads // kv)


def test_vocabulary_rows_padded_evenly() -> None:
    assert [vocab_shard(500, 3, r) for r in range(3)] == [(0, 167), (167, 167), (334, 167)]
    assert vocab_shard(49152, 3, 2) == (32768, 16384)


def _spec(**overrides: object) -> DecoderSpec:
    spec = DecoderSpec(vocab_size=VOCAB, hidden_size=96, intermediate_size=192, num_layers=2, num_heads=6,
                       num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
                       tie_word_embeddings=False)
    for name, value in overrides.items():
        setattr(spec, name, value)
    return spec


def test_refusals_name_what_is_not_supported() -> None:
    ok = dict(quantization=None)
    assert tensor_parallel_refusal(1, "gemma3_text", _spec(), **ok) is None
    assert tensor_parallel_refusal(3, "llama", _spec(), **ok) is None
    assert "does not divide the model's 6 query heads" in (tensor_parallel_refusal(4, "llama", _spec(), **ok) or "")
    assert "intermediate size" in (tensor_parallel_refusal(2, "llama", _spec(intermediate_size=191), **ok) or "")
    assert tensor_parallel_refusal(2, "gpt_oss", _spec(), **ok) is None
    assert "'falcon' is not supported" in (tensor_parallel_refusal(2, "falcon", _spec(), **ok) or "")
    experts = MoeSpec(num_experts=4, top_k=2, intermediate_size=34, norm_topk_prob=True, round_weights=False,
                      layers=(0, 1))
    assert "experts' intermediate size 34" in (tensor_parallel_refusal(3, "mixtral", _spec(moe=experts), **ok) or "")
    # Every layer sparse: the dense intermediate size (which no layer uses) need not divide.
    whole = MoeSpec(num_experts=4, top_k=2, intermediate_size=36, norm_topk_prob=True, round_weights=False,
                    layers=(0, 1))
    assert tensor_parallel_refusal(3, "mixtral", _spec(moe=whole, intermediate_size=191), **ok) is None
    assert "int8" in (tensor_parallel_refusal(2, "llama", _spec(), quantization="int8") or "")


def test_shard_spec_is_the_smaller_model_each_rank_runs() -> None:
    shard = ShardPlan.for_spec(_spec(), 1, 3).shard_spec(_spec())
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size, shard.vocab_size) == (2, 2, 64, 167)


def test_gpt_oss_sinks_go_with_their_query_heads_and_expert_biases_with_their_rows() -> None:
    plan = ShardPlan(rank=1, size=2, num_heads=4, num_kv_heads=1, head_dim=16, intermediate_size=64,
                     vocab_size=VOCAB, expert_intermediate_size=48, experts_in_out=True)
    assert plan.row_ranges("model.layers.0.self_attn.sinks") == [(2, 4)]
    assert plan.row_ranges("model.layers.0.self_attn.q_proj.bias") == [(32, 64)]
    assert plan.row_ranges("model.layers.0.self_attn.k_proj.bias") == [(0, 16)]  # the one KV head, on both


def test_stacked_experts_are_cut_along_each_experts_intermediate_dimension(tmp_path) -> None:
    from safetensors.torch import save_file

    from kvscale.server.worker.tp_shard import read_shard

    experts, hidden, inter = 2, 3, 4
    gate_up = torch.arange(experts * hidden * 2 * inter, dtype=torch.float32).view(experts, hidden, 2 * inter)
    stacked = {"gate_up_proj": gate_up, "gate_up_proj_bias": gate_up[:, 0],
               "down_proj": gate_up.transpose(1, 2)[:, :inter], "down_proj_bias": gate_up[:, :, 0]}
    save_file({f"model.layers.0.mlp.experts.{k}": v.contiguous() for k, v in stacked.items()},
              str(tmp_path / "m.safetensors"))

    def plan(rank: int, in_out: bool) -> ShardPlan:
        return ShardPlan(rank=rank, size=2, num_heads=2, num_kv_heads=2, head_dim=4, intermediate_size=8,
                         vocab_size=8, expert_intermediate_size=inter, experts_in_out=in_out)

    one = read_shard(tmp_path, plan(1, True), torch.float32)  # gpt-oss: gate, up interleaved by column
    assert torch.equal(one["model.layers.0.mlp.experts.gate_up_proj"], gate_up[:, :, 4:8])
    assert torch.equal(one["model.layers.0.mlp.experts.gate_up_proj_bias"], gate_up[:, 0, 4:8])
    assert torch.equal(one["model.layers.0.mlp.experts.down_proj"], gate_up.transpose(1, 2)[:, 2:4])
    assert not one["model.layers.0.mlp.experts.down_proj_bias"].any()  # rank 0 adds it, once
    zero = read_shard(tmp_path, plan(0, True), torch.float32)
    assert torch.equal(zero["model.layers.0.mlp.experts.down_proj_bias"], gate_up[:, :, 0])
    # transformers' Mixtral/Qwen3-MoE form: gate_up [experts, 2 * inter, hidden], gate rows then up rows.
    save_file({"model.layers.0.mlp.experts.gate_up_proj": gate_up.transpose(1, 2).contiguous()},
              str(tmp_path / "m.safetensors"))
    fused = read_shard(tmp_path, plan(1, False), torch.float32)["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(fused, gate_up.transpose(1, 2)[:, [2, 3, 6, 7]])
    # MXFP4 blocks: gpt-oss's alone are decoded (tests/server/worker/test_gpt_oss_mxfp4.py).
    save_file({"model.layers.0.mlp.experts.gate_up_proj_blocks": gate_up.to(torch.uint8)},
              str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match="MXFP4 experts"):
        read_shard(tmp_path, plan(0, False), torch.float32)


# --- engines of several ranks ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(bundled_model_path, tmp_path_factory):
    """Random weights in transformers' names with the bundled tokenizer and a 500-row vocabulary."""
    return write_tiny_tp_llama(bundled_model_path, tmp_path_factory.mktemp("tiny-llama-tp"), VOCAB)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 19, 40)]


def _engine(path, size: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", num_gpu_blocks_override=64,
                                  block_size=8, max_num_batched_tokens=24, tensor_parallel_size=size))


def _generate(engine: LLMEngine, prompts: list[list[int]], run_to_completion, tag: str) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                               ignore_eos=True))
    outputs = run_to_completion(engine)
    return {rid: list(out.outputs[0].token_ids) for rid, out in outputs.items()}


@pytest.fixture(scope="module")
def one_rank_tokens(tiny_llama) -> dict[str, list[int]]:
    def run_to_completion(engine: LLMEngine) -> dict:
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({out.request_id: out for out in engine.step() if out.finished})
        return finished

    tokens = _generate(_engine(tiny_llama, 1), _prompts(), run_to_completion, "p")
    assert len({t for row in tokens.values() for t in row}) > 3  # not a degenerate model
    return tokens


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_decode_as_one(size, tiny_llama, one_rank_tokens, one_thread_per_rank, run_to_completion) -> None:
    engine = _engine(tiny_llama, size)
    try:
        assert _generate(engine, _prompts(), run_to_completion, "p") == one_rank_tokens
        # The longest prompt again: its full blocks come from the prefix cache, read on every rank.
        hits_before = engine.kv.prefix_cache_hits
        again = _generate(engine, _prompts()[2:], run_to_completion, "again")
        assert engine.kv.prefix_cache_hits - hits_before >= 32
        assert again == {"again0": one_rank_tokens["p2"]}
        if size == 2:
            _a_killed_rank_fails_the_request_in_flight(engine)
    finally:
        engine.runner.close()  # type: ignore[attr-defined]


def _a_killed_rank_fails_the_request_in_flight(engine: LLMEngine) -> None:
    engine.add_request("doomed", _prompts()[1], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                                ignore_eos=True))
    engine.step()
    rank = engine.runner.ranks.processes[0]  # type: ignore[attr-defined]
    os.kill(rank.pid, signal.SIGKILL)
    rank.join()
    with pytest.raises(RankFailed, match=r"rank 1 \(pid \d+, exit code -9\)"):
        engine.step()
