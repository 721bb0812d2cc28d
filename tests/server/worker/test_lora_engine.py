"""LoRA adapters in the engine (server/worker/lora_adapter.py, lora_layers.py, lora_manager.py):
adapters made with PEFT on a tiny random-weight Llama; the engine's greedy tokens (float32) per
adapter equal transformers + PEFT's generate, base and two adapters in one batch each get their own
reference, a pool of one slot swaps adapters between steps, the prefix cache never shares a block
across adapters, and what the engine does not apply is refused by name.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_checkpoints import copy_tokenizer, write_tiny_llama  # noqa: E402

from bench.lora_adapters import ALL_LINEAR, peft_adapters
from kvscale.kernels import lora_cpu
from kvscale.server.config import EngineConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.lora_adapter import load_lora_adapter

VOCAB = 500
NEW_TOKENS = 6
# a1: every projection; a2: a few, another rank and rsLoRA's scaling.
ADAPTERS = {"a1": dict(r=4, lora_alpha=8, target_modules=ALL_LINEAR),
            "a2": dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True)}


def make_checkpoint_and_adapters(root: Path, bundled_model_path: Path, prompts: list[list[int]]):
    """The tiny checkpoint, a PEFT directory per ``ADAPTERS`` entry, and HF + PEFT's greedy
    tokens for each prompt: {None (base) or adapter name: [tokens per prompt]}."""
    from transformers import LlamaForCausalLM

    base_path = root / "base"
    base_path.mkdir()
    copy_tokenizer(bundled_model_path, base_path)
    write_tiny_llama(base_path, vocab=VOCAB, tie_word_embeddings=False, rms_norm_eps=1e-6,
                     max_position_embeddings=256, norm_jitter=0.1)

    def greedy(model) -> list[list[int]]:
        out = []
        with torch.inference_mode():
            for prompt in prompts:
                ids = torch.tensor([prompt])
                seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                     min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
                out.append(seq[0, len(prompt):].tolist())
        return out

    base = LlamaForCausalLM.from_pretrained(str(base_path), dtype=torch.float32).eval()
    refs: dict[str | None, list[list[int]]] = {None: greedy(base)}
    paths: dict[str, str] = {}
    for name, path, peft_model in peft_adapters(base, ADAPTERS, root):
        refs[name] = greedy(peft_model)
        paths[name] = path
    return base_path, paths, refs


@pytest.fixture(scope="module")
def lora_setup(bundled_model_path, tmp_path_factory):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 19)]
    base, paths, refs = make_checkpoint_and_adapters(tmp_path_factory.mktemp("lora"), bundled_model_path, prompts)
    assert refs["a1"] != refs[None] and refs["a2"] != refs[None], "adapters too weak to test anything"
    return base, paths, refs, prompts


def _engine(base: Path, paths: dict[str, str], **overrides) -> LLMEngine:
    settings = dict(model=str(base), dtype="float32", device="cpu", num_gpu_blocks_override=64, block_size=8,
                    max_num_batched_tokens=64, enable_lora=True, lora_modules=paths)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _clear_kernel_caches() -> None:
    from kvscale.kernels import cpu_build, cpu_native

    for cached in (cpu_build.library, cpu_native.amx_prefill_available, cpu_native.f32_prefill_available,
                   cpu_native.narrow_linear_available, cpu_native.amx_linear_available, lora_cpu.native_available):
        cached.cache_clear()


@pytest.fixture(params=["auto", "reference"])
def cpu_kernels(request, monkeypatch):
    """The C kernels where they build (the LoRA deltas in C), and PyTorch's forms alone."""
    monkeypatch.setenv("KVSCALE_CPU_KERNELS", request.param)
    _clear_kernel_caches()
    yield request.param
    monkeypatch.undo()
    _clear_kernel_caches()


def test_base_and_two_adapters_in_one_batch_each_match_peft(lora_setup, run_to_completion, cpu_kernels) -> None:
    base, paths, refs, prompts = lora_setup
    engine = _engine(base, paths, max_loras=2)
    for name in (None, "a1", "a2"):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{name}-{i}", prompt, _greedy(), lora_name=name)
    engine.step()
    # The first forward held base rows and both adapters' rows (a segment each, base rows in neither).
    groups = engine.runner.lora.batch.groups
    assert sorted(adapter.name for adapter, _ in groups) == ["a1", "a2"]
    assert all(rows is not None for _, rows in groups)
    outputs = run_to_completion(engine)
    for name in (None, "a1", "a2"):
        for i in range(len(prompts)):
            assert outputs[f"{name}-{i}"].outputs[0].token_ids == refs[name][i], (name, i)
    weights = engine.runner.lora.batch.weights
    assert lora_cpu.native_available() == (cpu_kernels == "auto")  # a C compiler is part of the test machine
    if cpu_kernels == "auto":
        # Every step's rows took the C kernel (kernels/lora_cpu.py), each projection's slots in a
        # table: a1 (slot 0) of rank 4 everywhere, a2 of rank 8 on q|k|v (on q and v only) and
        # down and none on gate|up; no stacked copy made.
        for key, ranks in (((0, "qkv_proj"), [4, 8]), ((0, "down_proj"), [4, 8]), ((0, "gate_up_proj"), [4, 0])):
            table = weights[key].native
            assert table is not None and table.table[:, 2].tolist() == ranks, key
            assert weights[key].dense is None
        return
    # Without it, the decode steps' few rows of both slots took the stacked path, one expand per
    # fused slice (kernels/lora_dense.py): q|k|v's ranks 4 and 8, a2 on q and v only; down's
    # both. gate|up is a1's alone, whose rows took its own pair.
    for key, slices in (((0, "qkv_proj"), 3), ((0, "down_proj"), 1)):
        stacked = weights[key].dense
        assert stacked is not None and len(stacked.b_slices) == slices, key
    assert weights[(0, "gate_up_proj")].dense is None


def test_one_slot_swaps_adapters_between_requests(lora_setup, run_to_completion) -> None:
    base, paths, refs, prompts = lora_setup
    engine = _engine(base, paths, max_loras=1)
    for turn, name in enumerate(("a1", "a2", None, "a1")):
        engine.add_request(f"t{turn}", prompts[1], _greedy(), lora_name=name)
        outputs = run_to_completion(engine)
        assert outputs[f"t{turn}"].outputs[0].token_ids == refs[name][1], name
        assert len(engine.runner.lora.resident) <= 1


def test_prefix_cache_is_keyed_by_adapter(lora_setup, run_to_completion) -> None:
    base, paths, _, prompts = lora_setup
    engine = _engine(base, paths)
    prompt = prompts[1]  # 19 tokens: two full blocks of 8 cacheable
    cached = {}
    for turn, name in enumerate((None, "a1", "a1", "a2", None)):
        engine.add_request(f"t{turn}", prompt, _greedy(), lora_name=name)
        cached[turn] = run_to_completion(engine)[f"t{turn}"].num_cached_tokens
    assert cached == {0: 0, 1: 0, 2: 16, 3: 0, 4: 16}


def test_an_unregistered_adapter_is_refused(lora_setup) -> None:
    base, paths, _, prompts = lora_setup
    engine = _engine(base, paths)
    with pytest.raises(ValueError, match="LoRA adapter 'nope' is not registered"):
        engine.add_request("x", prompts[0], _greedy(), lora_name="nope")


@pytest.mark.parametrize(("change", "message"), [
    ({"use_dora": True}, "use_dora is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"r": 32}, "rank 32 is above --max-lora-rank 16"),
    ({"target_modules": ["q_proj", "lm_head"]}, r"target_modules \['lm_head'\] are not supported"),
])
def test_what_the_engine_does_not_apply_is_refused(lora_setup, tmp_path, change, message) -> None:
    _, paths, _, _ = lora_setup
    shutil.copytree(paths["a1"], tmp_path / "a")
    config_file = tmp_path / "a" / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **change}))
    with pytest.raises(ValueError, match=message):
        load_lora_adapter("a", str(tmp_path / "a"), max_rank=16)


@pytest.mark.parametrize(("settings", "message"), [
    ({"tensor_parallel_size": 2}, "--tensor-parallel-size"),
    ({"quantization": "int8"}, "--quantization"),
    ({"enable_lora": False}, "--lora-modules needs --enable-lora"),
])
def test_settings_lora_cannot_run_with_are_refused(settings, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{"enable_lora": True, "lora_modules": {"a": "/x"}, **settings})


def test_the_adapter_keys_the_first_block_and_the_chain_carries_it() -> None:
    from kvscale.block_hash import hash_prompt_blocks

    tokens = list(range(32))
    base = hash_prompt_blocks(tokens, 8)
    assert hash_prompt_blocks(tokens, 8, lora_name=None) == base
    a1 = hash_prompt_blocks(tokens, 8, lora_name="a1")
    assert all(x != y for x, y in zip(a1, base, strict=True))
    assert hash_prompt_blocks(tokens, 8, "salt", lora_name="a1") != a1 != hash_prompt_blocks(tokens, 8, lora_name="a2")


def test_adapters_loaded_at_run_time_match_peft_through_a_host_pool_of_one(lora_setup, run_to_completion) -> None:
    from kvscale.server.engine.lora_updates import update_lora

    base, paths, refs, prompts = lora_setup
    engine = _engine(base, {}, max_loras=1, max_cpu_loras=1)
    lora = engine.runner.lora
    assert update_lora(engine, "a1", paths["a1"]) is None and update_lora(engine, "a2", paths["a2"]) is None
    assert list(lora._host) == ["a2"]  # one adapter in host memory: a1 was evicted
    reads = lora.reads
    for turn, name in enumerate(("a1", "a2", "a1")):
        engine.add_request(f"t{turn}", prompts[1], _greedy(), lora_name=name)
        assert run_to_completion(engine)[f"t{turn}"].outputs[0].token_ids == refs[name][1], name
    assert lora.reads == reads + 3  # each turn read its adapter again from its path
    assert update_lora(engine, "a1", paths["a2"]) == ("invalid", "LoRA adapter 'a1' is already loaded")


def test_an_unload_is_refused_while_the_adapter_serves(lora_setup, run_to_completion) -> None:
    from kvscale.server.engine.lora_updates import update_lora

    base, paths, _, prompts = lora_setup
    engine = _engine(base, {"a1": paths["a1"]}, max_loras=1)
    engine.add_request("r", prompts[0], _greedy(), lora_name="a1")
    assert engine.get_stats().waiting_lora_adapters == ["a1"]
    engine.step()
    assert engine.get_stats().running_lora_adapters == ["a1"]
    kind, why = update_lora(engine, "a1", None) or ("", "")
    assert kind == "busy" and "1 unfinished sequence" in why
    run_to_completion(engine)
    assert update_lora(engine, "a1", None) is None
    assert update_lora(engine, "a1", None) == ("not_found", "LoRA adapter 'a1' is not loaded")
    with pytest.raises(ValueError, match="not registered"):
        engine.add_request("again", prompts[0], _greedy(), lora_name="a1")


def test_the_registry_is_bounded_and_bad_adapters_leave_it_as_it_was(lora_setup, tmp_path, monkeypatch) -> None:
    from kvscale.server.engine.lora_updates import update_lora
    from kvscale.server.worker import lora_manager

    base, paths, _, _ = lora_setup
    engine = _engine(base, {"a1": paths["a1"]})
    kind, why = update_lora(engine, "bad", str(tmp_path)) or ("", "")
    assert kind == "invalid" and "must hold adapter_config.json" in why
    monkeypatch.setattr(lora_manager, "MAX_LORA_NAMES", 2)
    assert update_lora(engine, "a2", paths["a2"]) is None
    kind, why = update_lora(engine, "a3", paths["a2"]) or ("", "")
    assert kind == "invalid" and "(2)" in why
    assert set(engine.runner.lora.paths) == {"a1", "a2"}
    with pytest.raises(ValueError, match="--max-cpu-loras"):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)
