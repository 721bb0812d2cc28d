"""Projections laid out for the CPU's GEMM (server/worker/cpu_linear.py): packed weights compute what
``F.linear`` computes, the bf16 engine on the bundled model keeps transformers' probabilities,
and float32 keeps torch's GEMM (MKL) on Intel, oneDNN's packed layout on AMD."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from torch.nn import functional

from kvscale.kernels import cpu_native, layer_ops
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.cpu_features import CpuFeatures, cpu_features
from kvscale.server.worker.cpu_linear import (
    AMX,
    AMX_ROWS_MAX,
    DOT,
    DOT_ROWS_MAX,
    PackedLinear,
    RowKernel,
    RowKernelLinear,
    WidenedLinear,
    lay_out_cpu_linears,
    onednn_packs,
    packs_with_onednn,
    widened_matmul,
)

# bf16 products summed in float32 by both, in different orders.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def on_kernel(module: nn.Module, kernel: RowKernel) -> bool:
    """Whether ``module``'s few rows run on ``kernel``."""
    return isinstance(module, RowKernelLinear) and module.kernel is kernel


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_computes_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen)
    bias_tensor = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 80, generator=gen)
    packed = PackedLinear(weight, bias_tensor)
    expected = functional.linear(x, weight, bias_tensor)
    assert (packed(x) - expected).abs().max() <= TOLERANCE[torch.float32]
    # A non-contiguous input (a column slice of fused rows) gives the same.
    wide = torch.randn(rows, 160, generator=gen)
    assert (packed(wide[:, :80]) - functional.linear(wide[:, :80], weight, bias_tensor)).abs().max() <= 1e-4


def _projections(dtype: torch.dtype) -> nn.Module:
    model = nn.Module()
    model.embed = nn.Embedding(50, 16).to(dtype)
    model.block = nn.Sequential(nn.Linear(16, 32, bias=True), nn.Linear(32, 16, bias=False)).to(dtype)
    model.head = nn.Linear(16, 50, bias=False).to(dtype)
    model.head.weight = model.embed.weight  # tied, as the bundled model's LM head is
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_dtype_gets_the_layout_that_is_faster_here(dtype: torch.dtype) -> None:
    model = _projections(dtype)
    x = torch.randn(5, 16).to(dtype)
    before = model.head(model.block(x)).float()
    embedding = model.embed.weight.detach().clone()
    lay_out_cpu_linears(model)
    linears = [model.block[0], model.block[1], model.head]
    if onednn_packs(dtype):
        assert all(isinstance(m, PackedLinear) for m in linears)
        assert model.block[0].bias is not None and model.block[1].bias is None
    elif dtype == torch.bfloat16:
        # No bf16 GEMM kernels here: widened to float32 per call, the weights kept as they are.
        assert all(isinstance(m, WidenedLinear) for m in linears)
        assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    else:
        assert all(type(m) is nn.Linear for m in linears)
        # torch's GEMM reads the float32 weights as a transposed [in, out] buffer
        assert all(m.weight.t().is_contiguous() for m in linears)
    # The embedding still reads the matrix the head was tied to.
    assert torch.equal(model.embed.weight.detach(), embedding)
    after = model.head(model.block(x)).float()
    assert (after - before).abs().max() <= TOLERANCE[dtype] * max(1.0, before.abs().max().item())


@pytest.mark.parametrize("out_features", [40, 300])
def test_widened_matmul_sums_int8_codes_exactly_across_blocks(monkeypatch: pytest.MonkeyPatch,
                                                              out_features: int) -> None:
    """Blocks of 64 output channels (the smallest), so 300 takes four whole ones and a part: every
    block lands in its own columns, and the codes' sums are the integers torch._int_mm forms."""
    from kvscale.server.worker import cpu_linear

    monkeypatch.setattr(cpu_linear, "_WIDENED_BLOCK_BYTES", 1)
    gen = torch.Generator().manual_seed(out_features)
    # 576 inputs: any sum of products of codes stays below 2^24, exact in float32.
    codes = torch.randint(-127, 128, (out_features, 576), generator=gen, dtype=torch.int8)
    # More rows than the C path takes: the blocks widened into memory for float32's GEMM.
    x = torch.randint(-127, 128, (cpu_linear.NARROW_ROWS_MAX + 1, 576), generator=gen, dtype=torch.int8)
    expected = torch._int_mm(x, codes.t().contiguous())
    assert torch.equal(widened_matmul(x.float(), codes), expected.float())


def test_widened_decode_rows_run_in_c_and_more_rows_on_float32s_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvscale.server.worker import cpu_linear

    calls = []
    narrow = cpu_native.linear_narrow
    monkeypatch.setattr(cpu_native, "linear_narrow", lambda x, w: calls.append(x.shape[0]) or narrow(x, w))
    weight = torch.randn(70, 48).to(torch.bfloat16)
    for rows in (1, cpu_linear.NARROW_ROWS_MAX, cpu_linear.NARROW_ROWS_MAX + 1):
        x = torch.randn(rows, 48)
        assert (widened_matmul(x, weight) - x @ weight.float().t()).abs().max() < 1e-4
    assert calls == ([1, cpu_linear.NARROW_ROWS_MAX] if cpu_native.narrow_linear_available() else [])


@pytest.mark.parametrize("rows", [1, 33, 280])
def test_widened_bf16_linear_is_a_bf16_gemm_rounded_once(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(130, 96, generator=gen).to(torch.bfloat16)
    bias = torch.randn(130, generator=gen).to(torch.bfloat16)
    x = torch.randn(2, rows, 96, generator=gen).to(torch.bfloat16)
    got = WidenedLinear(weight, bias)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, rows, 130)
    # The exact products' sum plus the bias, rounded once to bf16: float32's summation order aside.
    exact = (x.double() @ weight.double().t() + bias.double()).to(torch.bfloat16)
    assert (got.float() - exact.float()).abs().max() <= 2 ** -7 * exact.float().abs().max()
    assert WidenedLinear(weight, None)(x).dtype == torch.bfloat16


def _decoder_sized(dtype: torch.dtype) -> nn.Module:
    """Projections whose sizes the AMX kernel takes (multiples of 32), and one it does not."""
    model = nn.Sequential(nn.Linear(64, 96, bias=True), nn.Linear(96, 64, bias=False), nn.Linear(64, 40))
    return model.to(dtype)


def test_bf16_decode_rows_run_on_amx_and_prefill_rows_on_onednn() -> None:
    model = _decoder_sized(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    inputs = {rows: torch.randn(rows, 64, generator=gen).to(torch.bfloat16) for rows in (1, 33, AMX_ROWS_MAX + 1)}
    before = {rows: model(x).float() for rows, x in inputs.items()}
    lay_out_cpu_linears(model)
    first, second, odd = model
    if not (onednn_packs(torch.bfloat16) and cpu_native.amx_linear_available()):
        assert not any(on_kernel(m, AMX) for m in model)
        return
    assert on_kernel(first, AMX) and on_kernel(second, AMX)
    assert type(odd) is PackedLinear  # 40 outputs: not whole blocks of 32
    for rows, x in inputs.items():
        after = model(x).float()
        assert (after - before[rows]).abs().max() <= TOLERANCE[torch.bfloat16] * max(1.0, before[rows].abs().max().item())
    # Which GEMM ran: the AMX copy alone serves up to AMX_ROWS_MAX rows, oneDNN's alone beyond.
    first.packed_weight = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(96, 64, dtype=torch.bfloat16), 64)
    assert first(inputs[33]).abs().sum() > 0
    assert torch.equal(first(inputs[AMX_ROWS_MAX + 1]), first.bias.expand(AMX_ROWS_MAX + 1, 96))


@pytest.mark.parametrize("rows", [1, 33, AMX_ROWS_MAX, AMX_ROWS_MAX + 1])
def test_the_mlp_activation_is_the_same_bits_fused_or_not(rows: int) -> None:
    """``projected_silu_and_mul`` on a bf16 gate|up: decode's rows on AMX with the activation
    applied as the kernel stores them, prefill's rows (and a plain ``nn.Linear``) through the
    projection and then the op: the same bits either way."""
    gen = torch.Generator().manual_seed(rows)
    gate_up = nn.Linear(64, 128, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16) * 4
    plain = layer_ops.silu_and_mul(gate_up(x))
    assert torch.equal(layer_ops.projected_silu_and_mul(gate_up, x), plain)
    holder = nn.Sequential(gate_up)
    lay_out_cpu_linears(holder)
    laid_out = holder[0]
    if not on_kernel(laid_out, AMX):
        assert not (onednn_packs(torch.bfloat16) and cpu_native.amx_linear_available())
        return
    fused = laid_out.silu_and_mul(x)
    assert (fused is None) == (rows > AMX_ROWS_MAX)
    two_ops = layer_ops.silu_and_mul(laid_out(x))
    assert torch.equal(layer_ops.projected_silu_and_mul(laid_out, x).view(torch.int16), two_ops.view(torch.int16))


def test_without_amx_few_bf16_rows_run_on_dot_products_and_more_on_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_native, "amx_linear_available", lambda: False)
    model = nn.Sequential(nn.Linear(64, 128, bias=True), nn.Linear(128, 64, bias=False), nn.Linear(64, 96))
    model = model.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    inputs = {rows: torch.randn(rows, 64, generator=gen).to(torch.bfloat16) for rows in (1, 5, DOT_ROWS_MAX + 1)}
    before = {rows: model(x).float() for rows, x in inputs.items()}
    lay_out_cpu_linears(model)
    first, second, odd = model
    if not (onednn_packs(torch.bfloat16) and cpu_native.dot_linear_available()):
        assert not any(on_kernel(m, DOT) for m in model)
        return
    assert on_kernel(first, DOT) and on_kernel(second, DOT)
    assert type(odd) is PackedLinear  # 96 outputs: not whole blocks of 64
    for rows, x in inputs.items():
        after = model(x).float()
        assert (after - before[rows]).abs().max() <= TOLERANCE[torch.bfloat16] * max(1.0, before[rows].abs().max().item())
    # Which GEMM ran: the dot copy alone serves up to DOT_ROWS_MAX rows, oneDNN's alone beyond.
    first.packed_weight = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(128, 64, dtype=torch.bfloat16), 64)
    assert first(inputs[5]).abs().sum() > 0
    assert torch.equal(first(inputs[DOT_ROWS_MAX + 1]), first.bias.expand(DOT_ROWS_MAX + 1, 128))
    # The MLP's activation fused into the store on the kernel's rows: the two ops' bits.
    x = inputs[5] * 4
    assert torch.equal(layer_ops.projected_silu_and_mul(first, x), layer_ops.silu_and_mul(first(x)))
    assert first.silu_and_mul(inputs[DOT_ROWS_MAX + 1]) is None


def test_onednn_alone_where_the_kernel_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_native, "amx_linear_available", lambda: False)
    model = _decoder_sized(torch.bfloat16)
    lay_out_cpu_linears(model)
    assert not any(on_kernel(m, AMX) for m in model)


INTEL = CpuFeatures("GenuineIntel", "Xeon", frozenset({"avx2", "avx512f", "amx_bf16"}))
AMD = CpuFeatures("AuthenticAMD", "EPYC", frozenset({"avx2", "avx512f", "avx512_bf16"}))


def test_float32_packs_off_intel_and_bf16_follows_onednn() -> None:
    # float32: MKL on Intel, oneDNN on AMD (MKL runs no AVX-512 code on other CPUs).
    assert packs_with_onednn(torch.float32, INTEL, onednn=True, onednn_bf16=True) is False
    assert packs_with_onednn(torch.float32, AMD, onednn=True, onednn_bf16=True) is True
    assert packs_with_onednn(torch.float32, AMD, onednn=False, onednn_bf16=False) is False
    arm = CpuFeatures("", "", frozenset({"asimd"}))  # torch on Arm: no MKL to route around
    assert packs_with_onednn(torch.float32, arm, onednn=True, onednn_bf16=False) is False
    # bf16: wherever oneDNN has bf16 kernels, whoever made the CPU.
    for cpu in (INTEL, AMD):
        assert packs_with_onednn(torch.bfloat16, cpu, onednn=True, onednn_bf16=True) is True
        assert packs_with_onednn(torch.bfloat16, cpu, onednn=True, onednn_bf16=False) is False
    assert packs_with_onednn(torch.float16, AMD, onednn=True, onednn_bf16=True) is False
    # This machine's answer is the decision applied to its own CPU.
    onednn = torch.backends.mkldnn.is_available()
    bf16 = onednn and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    for dtype in (torch.float32, torch.bfloat16):
        assert onednn_packs(dtype) is packs_with_onednn(dtype, cpu_features(), onednn, bf16)


def test_bf16_engine_keeps_transformers_probabilities(make_engine, run_to_completion, bundled_model_path) -> None:
    """Prompt logprobs (prefill's projections) and the generated tokens' logprobs (decode's)
    against transformers in bfloat16, teacher-forced on the tokens the engine chose: a wrong
    layout gives differences of whole nats, bf16 rounding 0.1-0.2 here."""
    engine = make_engine(dtype="bfloat16")
    prompts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, prompt_logprobs=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs = run_to_completion(engine)
    # Its own copy: the session's float32 transformers model must keep its float32 weights.
    hf = transformers.AutoModelForCausalLM.from_pretrained(bundled_model_path, dtype=torch.bfloat16)
    for i in range(len(prompts)):
        output = outputs[f"r{i}"]
        prompt_ids, generated = output.prompt_token_ids, output.outputs[0].token_ids
        ids = prompt_ids + generated
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float()
        expected = torch.log_softmax(logits, dim=-1)
        ours = [position[token].logprob for position, token in zip(output.prompt_logprobs[1:], prompt_ids[1:], strict=True)]
        ours += [position[token].logprob for position, token in zip(output.outputs[0].logprobs, generated, strict=True)]
        theirs = [expected[p - 1, token].item() for p, token in enumerate(ids) if p > 0]
        worst = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
        assert worst < 0.4, f"prompt {i}: logprobs differ by up to {worst:.3f}"
