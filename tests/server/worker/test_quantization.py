"""int8 weights (server/worker/quantization.py): the int8 projection computes F.linear to int8's
precision, smoothing changes nothing before rounding, and every way in refuses what it cannot run.
Accuracy on the bundled model: test_precision_accuracy.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional

from kvscale.server.config import EngineConfig
from kvscale.server.worker.model_llama import RMSNorm
from kvscale.server.worker.quantization import (
    Int8Linear,
    check_quantization,
    quantize_per_row,
    smooth_into,
)


def test_per_row_quantization_round_trips_within_half_a_step() -> None:
    t = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    t[2] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_per_row(t)
    assert q.dtype == torch.int8 and scale.shape == (6,)
    assert q.abs().max() <= 127
    assert ((q.float() * scale[:, None] - t).abs() <= scale[:, None] / 2 + 1e-7).all()
    assert torch.equal(q[2], torch.zeros_like(q[2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_int8_linear_computes_f_linear(rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(48, 96, generator=gen) * 0.05, torch.randn(48, generator=gen)
    x = torch.randn(rows, 96, generator=gen)
    layer = Int8Linear(weight.to(dtype), bias.to(dtype))
    got = layer(x.to(dtype))
    assert got.dtype == dtype and got.shape == (rows, 48)
    expected = functional.linear(x, weight, bias)
    # Two roundings to 1/254 of each row's range: ~1 % of the output's scale, far from a wrong layout.
    assert (got.float() - expected).abs().max() <= 0.02 * expected.abs().max()
    # A column slice of a wider tensor (as the fused q|k|v output is read) gives the same.
    wide = torch.cat([x, torch.randn(rows, 8, generator=gen)], dim=1).to(dtype)
    assert torch.equal(layer(wide[:, :96]), got)


def test_smoothing_keeps_the_function_before_rounding() -> None:
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(32, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32, generator=gen) * 4)
        norm.weight[3] = 40.0  # an outlier gain
    linear = nn.Linear(32, 16, bias=False)
    x = torch.randn(7, 32, generator=gen)
    before = linear(norm(x))
    smooth_into(norm.weight, linear)
    assert torch.allclose(linear(norm(x)), before, rtol=1e-4, atol=1e-5)
    assert norm.weight[3] < 40.0 / 2  # the outlier's range moved into the weight


def test_unknown_quantization_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"quantization 'awq' is not supported \(supported: int8\)"):
        EngineConfig(quantization="awq")
    with pytest.raises(ValueError, match="not supported"):
        check_quantization("fp8")
    check_quantization(None)
    check_quantization("int8", "cpu")


def test_int8_on_cuda_is_refused_not_ignored() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization("int8", "cuda")


def test_llm_takes_quantization(bundled_model_path) -> None:
    from kvscale.server.entrypoints.llm import LLM
    from kvscale.server.sampling_params import SamplingParams

    llm = LLM(dtype="float32", device="cpu", quantization="int8", num_gpu_blocks_override=16)
    projections = [m for m in llm.llm_engine.model.modules() if isinstance(m, Int8Linear)]
    assert len(projections) == 4 * llm.llm_engine.model.spec.num_layers + 1  # + the LM head
    assert not any(isinstance(m, nn.Linear) for m in llm.llm_engine.model.modules())
    # ignore_eos: " Paris." and end-of-text is a right answer too, and which one greedy picks
    # depends on the CPU's GEMM library (MKL on Intel, oneDNN on AMD).
    out = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="not supported"):
        LLM(quantization="gptq")


def test_serve_flag_spelled_as_vllm(capsys) -> None:
    import argparse

    from kvscale.server.entrypoints.cli_serve import _ENGINE_FIELDS, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--quantization", "int8"]).quantization == "int8"
    assert parser.parse_args([]).quantization is None
    assert "quantization" in _ENGINE_FIELDS
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "awq"])
    assert "invalid choice: 'awq'" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_with_int8_answers_through_the_openai_client() -> None:
    import sys
    from pathlib import Path

    import openai

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from api_helpers import ServeProcess

    server = ServeProcess("--quantization", "int8", "--dtype", "float32", "--device", "cpu",
                          "--num-gpu-blocks-override", "32", "--max-model-len", "256", log_name="serve-int8")
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        result = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert result.usage.completion_tokens == 4 and result.choices[0].text
    finally:
        server.stop()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prepacked_int8_gemm_gives_the_same_sums_as_int_mm(dtype: torch.dtype, monkeypatch) -> None:
    from kvscale.server.worker import quantization

    if not quantization.onednn_int8():
        # As the AMX kernels' tests: the engine never takes this path here (an AVX2 EPYC has no
        # VNNI), so there is nothing to compare; pytest reports it skipped, not passed.
        pytest.skip("no oneDNN int8 path on this CPU (no VNNI/AMX, or torch without qlinear ops): "
                    "the engine multiplies the codes in float32 here, which the other tests check")
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(200, 576, generator=gen) * 0.05, torch.randn(200, generator=gen)
    x = torch.randn(2, 32, 576, generator=gen).to(dtype)  # leading dims are flattened and kept
    prepacked = Int8Linear(weight, bias)
    monkeypatch.setattr(quantization, "onednn_int8", lambda: False)
    plain = Int8Linear(weight, bias)
    assert prepacked.prepacked and not plain.prepacked
    got, expected = prepacked(x), plain(x)
    assert got.shape == (2, 32, 200) and got.dtype == dtype
    # The same integer sums; the activation codes may differ by one on a rounding boundary.
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-3,
                               atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 40, 65])
def test_int8_mlp_activation_is_the_same_bits_fused_or_not(rows: int, dtype: torch.dtype) -> None:
    """An int8 gate|up with the activation applied as the AMX kernel stores decode's rows gives
    the bits of the projection followed by the layer op; prefill's rows (past 64) take the two."""
    from kvscale.kernels import cpu_native, layer_ops

    gen = torch.Generator().manual_seed(rows)
    gate_up = Int8Linear(torch.randn(256, 576, generator=gen) * 0.05, torch.randn(256, generator=gen))
    x = (torch.randn(rows, 576, generator=gen) * 4).to(dtype)
    fused = gate_up.silu_and_mul(x)
    assert (fused is None) == (gate_up.amx_weight is None or rows > 64)
    two_ops = layer_ops.silu_and_mul(gate_up(x))
    got = layer_ops.projected_silu_and_mul(gate_up, x)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert got.shape == (rows, 128) and torch.equal(got.view(bits), two_ops.view(bits))
    if cpu_native.amx_linear_available():
        assert gate_up.amx_weight is not None, "AMX here, yet the int8 weight was not laid out for it"


def test_int8_without_vnni_says_it_saves_memory_not_time(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    from kvscale.server.worker import quantization

    model = nn.Sequential(nn.Linear(32, 16))
    monkeypatch.setattr(quantization, "onednn_int8", lambda: False)
    with caplog.at_level("WARNING", logger="kvscale.server.worker.quantization"):
        assert quantization.quantize_linears(model) == 1
    assert any("without VNNI" in record.getMessage() and "float32's speed" in record.getMessage()
               for record in caplog.records)
    caplog.clear()
    monkeypatch.setattr(quantization, "onednn_int8", lambda: True)
    with caplog.at_level("WARNING", logger="kvscale.server.worker.quantization"):
        quantization.quantize_linears(nn.Sequential(nn.Linear(32, 16)))
    assert not caplog.records
