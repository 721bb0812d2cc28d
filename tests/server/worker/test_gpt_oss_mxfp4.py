"""gpt-oss checkpoints as the hub publishes them: each layer's experts in MXFP4 (``_blocks`` and
``_scales``), decoded at load (server/worker/mxfp4.py). A tiny random GptOssConfig model has its
experts quantized here (each 32-value block rounded to FP4 E2M1 under a shared power-of-two
scale, the published layout) and is read back by kvscale and by transformers, which dequantizes
MXFP4 on a CPU (``Mxfp4Config(dequantize=True)``): the decoded tensors equal, greedy tokens equal
and log-probabilities within float32's rounding, one rank and two."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from greedy_runs import greedy_runs  # noqa: E402
from tiny_checkpoints import copy_tokenizer  # noqa: E402

VOCAB = 512
NEW_TOKENS = 8
# FP4 E2M1's magnitudes by code (the sign is bit 3), from the OCP MX spec's table: the test's
# quantizer does not share kvscale's decoder.
MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# As gpt-oss-20b's config.json has it: everything but the experts stays unquantized.
QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def _config(intermediate_size: int = 64):
    import transformers

    # test_model_archs.py's gpt-oss with an intermediate size of whole 32-value blocks (one per
    # rank at two ranks): local, full, local layers, a window of 8 over blocks of 8, YaRN, a
    # SwiGLU limit the random projections reach.
    return transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=intermediate_size, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=8, swiglu_limit=1.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[experts, out, in]`` as MXFP4 blocks ``uint8 [experts, out, in / 32, 16]`` (even values in
    the low nibble) and E8M0 scales ``uint8 [experts, out, in / 32]`` (bias 127): each block's
    scale the smallest power of two that brings its largest magnitude within 6, each value the
    nearest E2M1."""
    experts, out, inputs = weight.shape
    grouped = weight.float().reshape(experts, out, inputs // 32, 32)
    exponent = torch.ceil(torch.log2(grouped.abs().amax(-1) / 6)).clamp(-127, 127)
    scaled = grouped / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.abs().unsqueeze(-1) - MAGNITUDES).abs().argmin(-1) | (scaled < 0).long() << 3
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def write_mxfp4_checkpoint(path: Path, bundled: Path, intermediate_size: int = 64) -> None:
    """transformers' random gpt-oss saved, its experts replaced by their MXFP4 blocks and scales
    under the hub's names and its config marked ``mxfp4``."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(intermediate_size)).eval()
    with torch.no_grad():  # random sinks and biases: fresh expert biases are zero
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "_bias", ".bias")):
                param.normal_(0, 0.5)
    model.save_pretrained(str(path))
    file = path / "model.safetensors"
    weights = load_file(str(file))
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize(weights.pop(name).transpose(1, 2))  # stored [experts, in, out]
        weights[name + "_blocks"], weights[name + "_scales"] = blocks, scales
    save_file(weights, str(file), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION_CONFIG}))
    copy_tokenizer(bundled, path)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory, bundled_model_path) -> Path:
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    write_mxfp4_checkpoint(path, bundled_model_path)
    return path


def _transformers_model(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                quantization_config=Mxfp4Config(dequantize=True)).eval()


def _run(path: Path, size: int = 1) -> dict[str, tuple[list[int], list[float]]]:
    return greedy_runs(path, size, VOCAB, NEW_TOKENS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_is_transformers_dequantization(dtype) -> None:
    """Every code in every nibble, scales from E8M0's smallest (2 ** -127) to large ones: equal
    to transformers' own MXFP4 dequantization bit for bit, in its [experts, in, out] layout."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from kvscale.server.worker.mxfp4 import decode_experts

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=gen)
    codes = torch.arange(16, dtype=torch.uint8)
    blocks[0, 0, 0] = codes | codes.flip(0) << 4  # each code in each nibble
    scales = torch.randint(100, 160, (3, 40, 4), dtype=torch.uint8, generator=gen)
    scales[0, :4, 0] = torch.tensor([0, 1, 127, 200], dtype=torch.uint8)
    got = decode_experts(blocks, scales, dtype)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert got.dtype == dtype and got.shape == expected.shape == (3, 128, 40)
    assert torch.equal(got, expected)
    assert len(got.unique()) > 100  # not degenerate


def test_the_test_quantizer_round_trips() -> None:
    """Values already on the E2M1 grid under a power-of-two scale come back exactly."""
    from kvscale.server.worker.mxfp4 import decode_experts

    gen = torch.Generator().manual_seed(0)
    signs = torch.where(torch.rand(2, 3, 64, generator=gen) < 0.5, -1.0, 1.0)
    grid = MAGNITUDES[torch.randint(0, 8, (2, 3, 64), generator=gen)] * signs
    grid[..., 0::32] = 6.0  # each block's largest magnitude: its scale is exactly 2 ** -3
    weight = grid / 8
    blocks, scales = quantize(weight)
    assert torch.equal(decode_experts(blocks, scales, torch.float32).transpose(1, 2), weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loaded_experts_equal_transformers_dequantized_model(mxfp4_checkpoint, dtype) -> None:
    """The expert weights kvscale's model loads from the MXFP4 file (before the CPU's GEMM layout
    packs them) are, for every expert, the projections transformers' dequantized model holds, in
    the model's dtype."""
    from safetensors.torch import load_file

    from kvscale.server.worker.model_config import load_model_config
    from kvscale.server.worker.model_gpt_oss import GptOssForCausalLM, gpt_oss_spec

    hf_model = _transformers_model(mxfp4_checkpoint, dtype)
    config = load_model_config(mxfp4_checkpoint)
    with torch.device("meta"):
        model = GptOssForCausalLM(gpt_oss_spec(config), config).to(dtype)
    weights = load_file(str(mxfp4_checkpoint / "model.safetensors"))
    assert weights["model.layers.0.mlp.experts.down_proj_blocks"].dtype == torch.uint8
    for i, hf_layer in enumerate(hf_model.model.layers):
        loaded = model._mlp_weights(weights.__getitem__, weights, f"model.layers.{i}.", i)
        experts = hf_layer.mlp.experts
        assert experts.gate_up_proj.dtype == loaded["mlp.experts.0.gate_up_proj.weight"].dtype == dtype
        for e in range(config.num_local_experts):
            gate_up = experts.gate_up_proj[e].t()
            assert torch.equal(loaded[f"mlp.experts.{e}.gate_up_proj.weight"],
                               torch.cat([gate_up[0::2], gate_up[1::2]]))
            assert torch.equal(loaded[f"mlp.experts.{e}.down_proj.weight"], experts.down_proj[e].t())
            assert torch.equal(loaded[f"mlp.experts.{e}.down_proj.bias"].to(dtype), experts.down_proj_bias[e])


def test_engine_greedy_equals_transformers_on_the_mxfp4_checkpoint(mxfp4_checkpoint) -> None:
    hf_model = _transformers_model(mxfp4_checkpoint, torch.float32)
    got = _run(mxfp4_checkpoint)
    assert len({t for tokens, _ in got.values() for t in tokens}) > 3  # not degenerate
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for i, n in enumerate((5, 19, 40)):
            ids = torch.randint(3, VOCAB, (1, n), generator=gen)
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True, pad_token_id=0)
            tokens, logprobs = got[str(i)]
            assert tokens == ref.sequences[0, n:].tolist(), i
            expected = [float(torch.log_softmax(logits[0].float(), dim=-1)[t]) for logits, t in zip(ref.logits, tokens,
                                                                                                    strict=True)]
            assert logprobs == pytest.approx(expected, abs=1e-4), i


def test_checkpoint_elements_count_the_decoded_values(mxfp4_checkpoint) -> None:
    """The fit check sizes the weights in the model's dtype: MXFP4 experts as the values they
    decode to, as many as transformers' dequantized model holds."""
    from kvscale.server.worker.model_loader import checkpoint_elements

    hf_model = _transformers_model(mxfp4_checkpoint, torch.float32)
    assert checkpoint_elements(mxfp4_checkpoint) == sum(p.numel() for p in hf_model.parameters())


def test_mxfp4_outside_the_experts_is_refused() -> None:
    from kvscale.server.worker.mxfp4 import mxfp4_refusal

    experts = [f"model.layers.0.mlp.experts.{p}_{s}" for p in ("gate_up_proj", "down_proj") for s in ("blocks", "scales")]
    assert mxfp4_refusal(experts + ["model.layers.0.self_attn.q_proj.weight"]) is None
    why = mxfp4_refusal(experts + ["model.layers.0.self_attn.q_proj.weight_blocks"])
    assert why is not None and "q_proj.weight_blocks" in why


def test_other_quantizations_are_refused() -> None:
    from kvscale.server.worker.model_gpt_oss import gpt_oss_spec

    config = _config()
    config.quantization_config = QUANTIZATION_CONFIG
    assert gpt_oss_spec(config).moe is not None  # MXFP4 experts: read
    config.quantization_config = {"quant_method": "gptq"}
    with pytest.raises(ValueError, match="'gptq'"):
        gpt_oss_spec(config)


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_reads_the_blocks_of_its_slices(mxfp4_checkpoint, size) -> None:
    """A rank's blocks and scales, decoded, are its slices of the whole decoded projections, cut
    as unquantized stacked experts are: gate|up by its interleaved output columns, down by its
    input rows. Four ranks hold 16 of the 64 rows each, half a block: down's covering block is
    decoded as it is read and the rank's rows kept."""
    from safetensors.torch import load_file

    from kvscale.server.worker.model_config import load_model_config
    from kvscale.server.worker.model_loader import model_spec
    from kvscale.server.worker.mxfp4 import decode_experts
    from kvscale.server.worker.tp_shard import ShardPlan, read_shard

    full = load_file(str(mxfp4_checkpoint / "model.safetensors"))
    spec = model_spec(load_model_config(mxfp4_checkpoint))
    experts = "model.layers.1.mlp.experts."

    def decoded(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        return decode_experts(weights[experts + name + "_blocks"], weights[experts + name + "_scales"], torch.float32)

    share = 64 // size
    for rank in range(size):
        shard = read_shard(mxfp4_checkpoint, ShardPlan.for_spec(spec, rank, size), torch.float32)
        first, end = rank * share, (rank + 1) * share
        assert torch.equal(decoded(shard, "gate_up_proj"), decoded(full, "gate_up_proj")[:, :, 2 * first:2 * end])
        down = decoded(shard, "down_proj") if share % 32 == 0 else shard[experts + "down_proj"]
        assert torch.equal(down, decoded(full, "down_proj")[:, first:end])


def test_two_ranks_decode_the_mxfp4_checkpoint_as_one(tmp_path, bundled_model_path, one_thread_per_rank) -> None:
    """Each rank reads and decodes its slices of the blocks alone (server/worker/tp_shard.py): 48
    of 96 intermediate rows each, down's middle block read and decoded by both, gate|up's blocks
    by the model (whole shares: test_each_rank_reads_the_blocks_of_its_slices)."""
    write_mxfp4_checkpoint(tmp_path, bundled_model_path, 96)
    one = _run(tmp_path, 1)
    assert len({t for tokens, _ in one.values() for t in tokens}) > 3  # not degenerate
    two = _run(tmp_path, 2)
    assert {rid: tokens for rid, (tokens, _) in two.items()} == {rid: tokens for rid, (tokens, _) in one.items()}
    for rid, (_, logprobs) in two.items():
        assert logprobs == pytest.approx(one[rid][1], abs=1e-4), rid
