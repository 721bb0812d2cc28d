"""A sharded checkpoint is the files its index names (model.safetensors.index.json), as
transformers reads it: other .safetensors beside them (Mistral's repositories ship
consolidated.safetensors, the same weights under other names, next to the hub's shards) are not
part of the model, for the single-process load, a tensor-parallel rank's slices or the start-up
fit check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_checkpoints import copy_tokenizer, write_tiny_llama  # noqa: E402

from kvscale.server.worker.model_loader import checkpoint_elements, checkpoint_files
from kvscale.server.worker.tp_shard import ShardPlan, read_shard


def _shard(tiny: Path, shards: int) -> dict[str, str]:
    """Re-save ``tiny``'s one file as ``shards`` files with the hub's index; the weight map."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tiny / "model.safetensors"))
    (tiny / "model.safetensors").unlink()
    names = sorted(weights)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: weights[n] for n in part}, str(tiny / file))
        weight_map.update(dict.fromkeys(part, file))
    (tiny / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def _tiny(path: Path) -> Path:
    path.mkdir()
    write_tiny_llama(path, vocab=128, tie_word_embeddings=False, rms_norm_eps=1e-5,
                     max_position_embeddings=128, norm_jitter=0.1)
    return path


def _consolidated_beside(path: Path) -> None:
    """The checkpoint's weights again in one file under Mistral's own names, as its repositories
    ship consolidated.safetensors beside the hub's shards."""
    from safetensors.torch import save_file

    weights = {}
    for file in checkpoint_files(path):
        weights.update(load_file(str(file)))
    save_file({n.removeprefix("model.").replace("self_attn.q_proj", "attention.wq"): t for n, t in weights.items()},
              str(path / "consolidated.safetensors"))


def test_the_index_names_the_files_and_a_stray_file_beside_them_is_not_read(tmp_path) -> None:
    single = _tiny(tmp_path / "single")
    elements = checkpoint_elements(single)
    whole = load_file(str(single / "model.safetensors"))
    sharded = _tiny(tmp_path / "sharded")
    weight_map = _shard(sharded, 3)
    _consolidated_beside(sharded)

    assert [f.name for f in checkpoint_files(sharded)] == sorted(set(weight_map.values()))
    assert checkpoint_elements(sharded) == elements
    plan = ShardPlan(rank=1, size=2, num_heads=6, num_kv_heads=2, head_dim=16, intermediate_size=192,
                     vocab_size=128)
    rank = read_shard(sharded, plan, torch.float32)
    assert set(rank) == set(whole)
    assert torch.equal(rank["model.layers.0.self_attn.q_proj.weight"],
                       whole["model.layers.0.self_attn.q_proj.weight"][48:96])


def test_a_directory_without_an_index_is_its_safetensors_files(tmp_path) -> None:
    single = _tiny(tmp_path / "m")
    assert [f.name for f in checkpoint_files(single)] == ["model.safetensors"]


def test_the_engine_loads_a_sharded_checkpoint_as_the_one_file(tmp_path, bundled_model_path,
                                                                run_to_completion) -> None:

    from kvscale.server.config import EngineConfig
    from kvscale.server.engine.llm_engine import LLMEngine
    from kvscale.server.sampling_params import SamplingParams

    tokens = []
    for name, shards in (("single", 1), ("sharded", 2)):
        path = _tiny(tmp_path / name)
        copy_tokenizer(bundled_model_path, path)
        if shards > 1:
            _shard(path, shards)
            _consolidated_beside(path)
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", num_gpu_blocks_override=16,
                                        block_size=8))
        engine.add_request("0", [5, 9, 17, 33, 2, 64], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        tokens.append(run_to_completion(engine)["0"].outputs[0].token_ids)
    assert tokens[0] == tokens[1]


def test_an_index_naming_a_missing_file_or_one_outside_the_directory_is_refused(tmp_path) -> None:

    path = _tiny(tmp_path / "m")
    index = path / "model.safetensors.index.json"
    for weight_map, error, match in (({"a": "model-00002-of-00002.safetensors"}, FileNotFoundError, "not in"),
                                     ({"a": "../model.safetensors"}, ValueError, "outside"),
                                     ({}, ValueError, "no weight_map")):
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(error, match=match):
            checkpoint_files(path)
