"""bench.moe_decode's pure parts: its flags, the checkpoint it writes (at a tiny size), the
prompts, the decode rate of a pass and the paired ratios. No vLLM."""

from __future__ import annotations

import json

import pytest

from bench.moe_decode import (
    decode_tok_s,
    parse_args,
    prompts_of,
    rotated,
    shape_of,
    summarize,
    write_checkpoint,
)


def test_the_flags_give_the_shape_and_the_batches() -> None:
    args = parse_args(["--experts", "16", "--top-k", "2", "--batches", "1,4,16"])
    assert args.batch_sizes == [1, 4, 16]
    assert shape_of(args) == {"hidden": 512, "layers": 4, "experts": 16, "top_k": 2, "moe_intermediate": 256,
                              "vocab": 4096, "heads": 8, "kv_heads": 4, "head_dim": 64}
    with pytest.raises(SystemExit):
        parse_args(["--output-len", "1"])


def test_the_checkpoint_is_a_qwen3_moe_that_kvscale_reads_with_its_experts(tmp_path) -> None:
    from safetensors import safe_open

    from kvscale.server.worker.model_config import load_model_config
    from kvscale.server.worker.model_moe import qwen3_moe_spec

    shape = {"hidden": 64, "layers": 2, "experts": 6, "top_k": 2, "moe_intermediate": 32, "vocab": 300,
             "heads": 4, "kv_heads": 2, "head_dim": 16}
    write_checkpoint(tmp_path, shape, "bfloat16", 128, tokenizer_from=None)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.1.mlp.experts.5.up_proj.weight").shape == (32, 64)
    assert "model.layers.0.mlp.gate.weight" in names
    moe = qwen3_moe_spec(load_model_config(tmp_path)).moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.layers) == (6, 2, (0, 1))


def test_prompts_are_fixed_and_inside_the_vocabulary() -> None:
    prompts = prompts_of(16, 32, 300)
    assert prompts == prompts_of(16, 32, 300) and len({tuple(p) for p in prompts}) == 16
    assert all(len(p) == 32 and 3 <= min(p) and max(p) < 300 for p in prompts)


def test_decode_rate_counts_the_tokens_after_the_first_over_the_time_they_added() -> None:
    assert decode_tok_s(16, 129, 2.5, 0.5) == pytest.approx(16 * 128 / 2.0)
    with pytest.raises(ValueError, match="no longer than one"):
        decode_tok_s(1, 64, 0.1, 0.2)


def test_the_summary_pairs_each_rounds_ratios() -> None:
    tok_s = {"16": {"kvscale": [300.0, 330.0, 240.0], "vllm": [200.0, 300.0, 100.0],
                    "kvscale_before": [150.0, 165.0, 240.0]}}
    summary = summarize(tok_s, "vllm")["16"]
    assert summary["tok_s_median"] == {"kvscale": 300.0, "vllm": 200.0, "kvscale_before": 165.0}
    # Paired per round (1.5, 1.1, 2.4), not the ratio of the medians (1.5).
    assert summary["over_vllm"]["kvscale"] == pytest.approx({"median": 1.5, "min": 1.1, "max": 2.4})
    assert summary["kvscale_over_before"]["median"] == pytest.approx(2.0)
    assert [rotated(["a", "b", "c"], r)[0] for r in range(4)] == ["a", "b", "c", "a"]
