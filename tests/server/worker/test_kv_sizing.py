"""Sizing the KV cache from a measured profiling pass: the pure decisions (how the largest step is
shaped, how many blocks fit) and the pass itself on the bundled model on CPU."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from kvscale.server.config import EngineConfig
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.kv_sizing import (
    GIB,
    kv_cache_blocks,
    pass_decides_pool,
    profile_shape,
    smallest_kv_bytes,
    weights_fit_refusal,
)

MIB = 1024**2


# --- the shape of the largest step ---------------------------------------------------------


def test_profile_shape_spreads_the_token_budget_over_max_num_seqs():
    assert profile_shape(2048, 64, 8192) == [32] * 64
    lengths = profile_shape(100, 8, 8192)
    assert sum(lengths) == 100 and len(lengths) == 8 and max(lengths) - min(lengths) == 1


def test_profile_shape_never_more_sequences_than_tokens_nor_longer_than_max_model_len():
    assert profile_shape(5, 64, 8192) == [1] * 5
    # 4 sequences of at most 10 tokens cannot use a 100-token budget.
    assert profile_shape(100, 4, 10) == [10] * 4
    assert profile_shape(7, 1, 8192) == [7]


def test_profile_shape_rejects_non_positive_limits():
    with pytest.raises(ValueError, match="max_num_seqs \\(0\\)"):
        profile_shape(16, 0, 64)


# --- blocks from measured memory -----------------------------------------------------------


def test_blocks_are_what_is_left_of_the_utilization_after_weights_and_peak():
    blocks = kv_cache_blocks(80 * GIB, 10 * GIB, 2 * GIB, 0.9, 2 * MIB, block_size=16)
    assert blocks == (72 - 10 - 2) * 512
    # A partial block does not count; memory use is in bytes, not whole GiB.
    assert kv_cache_blocks(100, 10, 5, 1.0, 40, block_size=16) == 2
    assert kv_cache_blocks(10 * MIB, 0, 0, 0.5, MIB, block_size=1) == 5


def test_not_one_block_fits_names_the_numbers():
    with pytest.raises(ValueError) as info:
        kv_cache_blocks(16 * GIB, 14 * GIB, GIB, 0.9, 2 * MIB, block_size=16)
    message = str(info.value)
    for figure in ("0.9 of 16.00 GiB", "14.40 GiB", "14.00 GiB", "1.00 GiB", "-0.60 GiB", "2097152 bytes"):
        assert figure in message, (figure, message)
    assert "--gpu-memory-utilization" in message
    # Exactly one block short.
    with pytest.raises(ValueError, match="less than one block"):
        kv_cache_blocks(100, 50, 11, 1.0, 40, block_size=16)
    assert kv_cache_blocks(100, 50, 10, 1.0, 40, block_size=16) == 1


def test_an_explicit_max_model_len_must_fit_one_sequence():
    # 10 blocks of 16 tokens = 160 tokens.
    args = (100 * MIB, 0, 0, 1.0, 10 * MIB)
    assert kv_cache_blocks(*args, block_size=16, max_model_len=160) == 10
    with pytest.raises(ValueError) as info:
        kv_cache_blocks(*args, block_size=16, max_model_len=161)
    message = str(info.value)
    assert "max_model_len 161" in message and "needs 11 KV blocks" in message and "only 10 fit" in message
    assert "--max-model-len" in message and "at most 160 fits" in message
    # Without one (the model's default length), the engine caps the length instead.
    assert kv_cache_blocks(*args, block_size=16) == 10


def test_a_checkpoint_that_cannot_fit_a_device_is_refused_with_its_figures():
    # gpt-oss-120b's 117 B numbers in bfloat16 (234 GB) on 139 GiB H200s at 0.9, 1 GiB in use.
    weights, total, used = 117_000_000_000 * 2, 139 * GIB, GIB
    why = weights_fit_refusal(weights, 1, GIB, used, total, 0.9) or ""
    assert "at least 217.93 GiB a device and the smallest KV cache 1.00 GiB more" in why
    assert "0.9 of the device's 139.00 GiB less the 1.00 GiB already in use leaves 124.10 GiB" in why
    assert "--tensor-parallel-size" in why
    # Split over 2 devices each holds 108.96 GiB: it fits, until the KV cache asked for does not.
    assert weights_fit_refusal(weights, 2, GIB, used, total, 0.9) is None
    why = weights_fit_refusal(weights, 2, 20 * GIB, used, total, 0.9) or ""
    assert "108.96 GiB a device (217.93 GiB over 2 devices)" in why
    assert weights_fit_refusal(weights, 4, 0, used, total, 0.9) is None


def test_the_smallest_kv_cache_is_the_pool_asked_for_or_one_sequence():
    block = 1000
    assert smallest_kv_bytes(EngineConfig(num_gpu_blocks_override=64), block) == 64 * block
    assert smallest_kv_bytes(EngineConfig(kv_cache_memory_bytes=12345), block) == 12345
    assert smallest_kv_bytes(EngineConfig(max_model_len=4097, block_size=16), block) == 257 * block
    assert smallest_kv_bytes(EngineConfig(), block) == block  # the length is capped at what fits


def test_checkpoint_elements_come_from_the_headers(tmp_path):
    from safetensors.torch import save_file

    from kvscale.server.worker.model_loader import checkpoint_elements

    assert checkpoint_elements(tmp_path) is None  # no safetensors (a .bin checkpoint's sizes need the load)
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}, str(tmp_path / "x.safetensors"),
              metadata={"format": "pt"})
    save_file({"c": torch.zeros(2, 2, 2)}, str(tmp_path / "y.safetensors"))
    assert checkpoint_elements(tmp_path) == 12 + 5 + 8


def test_the_bundled_checkpoint_is_measured_against_a_device_before_it_loads(bundled_model_path):
    """The start-up check's figures from the checkpoint's headers and config (the device's memory
    given: the test runs without a GPU)."""
    from kvscale.server.engine.engine_build import checkpoint_fit_refusal
    from kvscale.server.worker.model_config import load_model_config

    config = load_model_config(bundled_model_path)
    settings = EngineConfig(max_model_len=2048, gpu_memory_utilization=0.9)
    # SmolLM2-135M's 134.5 M numbers, 0.50 GiB in float32, 0.25 GiB in bfloat16.
    why = checkpoint_fit_refusal(settings, bundled_model_path, config, torch.float32, torch.float32, 0, GIB // 2) or ""
    assert "at least 0.50 GiB a device and the smallest KV cache 0.09 GiB more" in why, why
    assert checkpoint_fit_refusal(settings, bundled_model_path, config, torch.bfloat16, torch.bfloat16, 0,
                                  GIB // 2) is None


def test_bad_block_geometry_is_rejected():
    with pytest.raises(ValueError, match="block_bytes"):
        kv_cache_blocks(GIB, 0, 0, 0.9, 0, block_size=16)


# --- the pass on the bundled model (CPU) ---------------------------------------------------


def test_the_pass_runs_only_where_it_sizes_the_pool():
    assert pass_decides_pool("cuda", None, None)
    assert not pass_decides_pool("cuda", 2**30, None)  # an explicit budget decides
    assert not pass_decides_pool("cuda", None, 128)  # so does an explicit block count
    assert not pass_decides_pool("cpu", None, None)  # the CPU budget is a fixed number


def test_a_cpu_engine_starts_without_the_pass(make_engine, caplog):
    # Every CPU start (and every test server) would pay for a pass whose result nothing reads.
    with caplog.at_level(logging.INFO, logger="kvscale.server.worker.kv_sizing"):
        engine = make_engine(max_num_batched_tokens=48, max_num_seqs=6)
    assert engine.step_profile is None
    assert "profiling pass" not in caplog.text
    assert engine.num_blocks == 256  # the override decides the pool


def test_measured_peak_holds_every_rows_logits_and_grows_with_the_step(make_engine):
    engine = make_engine(max_num_batched_tokens=16, max_num_seqs=4, num_gpu_blocks_override=16)
    vocab = engine.model.spec.vocab_size
    peaks = {}
    for num_tokens in (64, 512):
        profile = engine.runner.profile_run(profile_shape(num_tokens, 8, 4096), engine.sampler)
        assert (profile.num_tokens, profile.num_seqs) == (num_tokens, 8)
        peaks[num_tokens] = profile.peak_bytes
        # Every row's float32 logits exist at once (prompt logprobs), so the mark cannot be lower.
        assert peaks[num_tokens] >= num_tokens * vocab * 4, (num_tokens, peaks[num_tokens])
    assert peaks[512] > peaks[64] + (512 - 64) * vocab * 4


def test_profiling_pass_leaves_nothing_behind(make_engine, run_to_completion, greedy_prompts, hf_greedy_tokens):
    engine = make_engine(max_num_batched_tokens=64, max_num_seqs=4, num_gpu_blocks_override=32)
    first, second = greedy_prompts[2], greedy_prompts[1]
    engine.add_request("before", first, SamplingParams(temperature=0.0, max_tokens=16))
    assert run_to_completion(engine)["before"].outputs[0].token_ids == hf_greedy_tokens[first]
    engine.drain_kv_events()
    cache = engine.runner.kv_cache
    snapshot = cache.clone()
    hashes = engine.cached_block_hashes()
    stats = engine.get_stats()
    assert hashes and stats.kv_blocks_cached > 0

    gc.collect()
    tensors_before = {id(o) for o in gc.get_objects() if issubclass(type(o), torch.Tensor)}
    engine.runner.profile_run(profile_shape(64, 4, engine.max_model_len), engine.sampler)
    gc.collect()
    left = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and id(o) not in tensors_before]
    assert not left, [tuple(t.shape) for t in left]

    # The real cache is the same tensor with the same contents; the pool saw nothing.
    assert engine.runner.kv_cache is cache and torch.equal(cache, snapshot)
    del snapshot
    assert engine.drain_kv_events() == [] and engine.cached_block_hashes() == hashes
    after = engine.get_stats()
    assert (after.kv_blocks_active, after.kv_blocks_cached) == (0, stats.kv_blocks_cached)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    # And requests still match transformers, including one reading the cached prefix.
    engine.add_request("after", second, SamplingParams(temperature=0.0, max_tokens=16))
    engine.add_request("again", first, SamplingParams(temperature=0.0, max_tokens=16))
    outputs = run_to_completion(engine)
    assert outputs["after"].outputs[0].token_ids == hf_greedy_tokens[second]
    assert outputs["again"].outputs[0].token_ids == hf_greedy_tokens[first]
    assert outputs["again"].num_cached_tokens > 0


# --- the meter -----------------------------------------------------------------------------


def test_cpu_meter_measures_what_the_work_touches_and_resets_between_uses():
    from kvscale.server.worker.memory_profile import MemoryMeter

    cpu = torch.device("cpu")
    with MemoryMeter(cpu) as meter:
        block = torch.ones(64 * MIB // 4)  # every page written
        del block
    # A few pages of the block may land on memory already resident (a freed chunk malloc_trim could
    # not hand back whole, after other tests ran in this process): most of it is new.
    assert meter.peak_bytes is not None and 60 * MIB <= meter.peak_bytes < 96 * MIB, meter.peak_bytes
    # The high-water mark starts again from the current RSS: the earlier 64 MiB is not carried.
    with MemoryMeter(cpu) as idle:
        pass
    assert idle.peak_bytes is not None and idle.peak_bytes < 8 * MIB, idle.peak_bytes
