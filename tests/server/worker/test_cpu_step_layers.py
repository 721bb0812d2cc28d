"""A step's layers in one C call (server/worker/cpu_step_layers.py) against the modules' path:
the same bits out, the same KV written, and the modules wherever a kernel would not apply."""

from __future__ import annotations

import pytest
import torch

from kvscale.kernels import cpu_native
from kvscale.server.worker import cpu_linear, quantization
from kvscale.server.worker.attention_metadata import AttentionMetadata
from kvscale.server.worker.cpu_linear import AMX_ROWS_MAX, DOT_ROWS_MAX
from kvscale.server.worker.cpu_step_layers import STEP_ROWS_MAX, CpuStepLayers
from kvscale.server.worker.model_llama import DecoderForCausalLM, spec_from_hf_config

BLOCK_SIZE = 16
NUM_BLOCKS = 1024


def _model(quantization: str | None = None, bias: bool = False, qk_norm: bool = False) -> DecoderForCausalLM:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, attention_bias=bias,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config)
    weights = {name: tensor.detach().to(torch.bfloat16) for name, tensor in hf.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    for name in weights:
        if name.endswith(("_proj.weight", "lm_head.weight")):
            weights[name] = (torch.randn(weights[name].shape, generator=gen) * 0.1).to(torch.bfloat16)
        elif name.endswith("_proj.bias"):  # freshly initialised biases are zero
            weights[name] = torch.randn(weights[name].shape, generator=gen).to(torch.bfloat16)
        elif name.endswith("norm.weight"):
            weights[name] = (1 + 0.2 * torch.randn(weights[name].shape, generator=gen)).to(torch.bfloat16)
    spec = spec_from_hf_config(config)
    spec.qk_norm = qk_norm
    model = DecoderForCausalLM(spec, config).to(torch.bfloat16)
    if qk_norm:
        for i in range(spec.num_layers):
            for norm in ("q_norm", "k_norm"):
                weights[f"model.layers.{i}.self_attn.{norm}.weight"] = torch.ones(spec.head_dim, dtype=torch.bfloat16)
    model.load_hf_weights(weights, quantization=quantization)
    model.build_rope_cache(512)
    return model


def _caches(model: DecoderForCausalLM, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    shape = (NUM_BLOCKS, BLOCK_SIZE, model.spec.num_kv_heads, model.spec.head_dim)
    return [tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(2))  # type: ignore[misc]
            for _ in range(model.spec.num_layers)]


def _step(query_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Sequences of random lengths, each with ``query_lens[i]`` new tokens at its end (1: a decode),
    on blocks of their own in shuffled order; a decode step where every sequence has one."""
    gen = torch.Generator().manual_seed(len(query_lens))
    lens = [int(torch.randint(n, n + 100, (1,), generator=gen)) for n in query_lens]
    needed = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in lens]
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[: sum(needed)].tolist()
    tables = torch.zeros(len(lens), max(needed), dtype=torch.int32)
    positions: list[int] = []
    for row, count in enumerate(needed):
        tables[row, :count] = torch.tensor(blocks[:count], dtype=torch.int32)
        del blocks[:count]
        positions.extend(range(lens[row] - query_lens[row], lens[row]))
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    seq_of = [row for row, n in enumerate(query_lens) for _ in range(n)]
    slots = torch.tensor([int(tables[s, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                          for s, p in zip(seq_of, positions, strict=True)], dtype=torch.int64)
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, context_lens=torch.tensor(lens, dtype=torch.int32),
                             query_start_loc=torch.tensor(starts, dtype=torch.int32),
                             is_decode=all(n == 1 for n in query_lens), kernels=cpu_native.CPU,
                             max_query_len=max(query_lens))
    ids = torch.randint(0, 256, (starts[-1],), generator=gen)
    return ids, torch.tensor(positions, dtype=torch.int64), meta


def _decode_step(rows: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    return _step([1] * rows)


def _both_paths(model: DecoderForCausalLM, rows: int, cache_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch,
                step: tuple[torch.Tensor, torch.Tensor, AttentionMetadata] | None = None):
    ids, positions, meta = step or _decode_step(rows)
    logits_rows = torch.arange(rows)
    one_call_caches = _caches(model, cache_dtype)
    assert model._one_call_layers(rows, one_call_caches, meta) is not None  # the path under test ran
    one_call = model.hidden_states(ids, positions, one_call_caches, meta, logits_rows)
    monkeypatch.setattr(CpuStepLayers, "for_model", classmethod(lambda cls, model: None))
    # Past the modules' own AMX rows the one call keeps the AMX kernel where the modules would
    # take oneDNN's GEMM: the same kernel on both sides, for the same bits.
    monkeypatch.setattr(cpu_linear, "AMX_ROWS_MAX", STEP_ROWS_MAX)
    monkeypatch.setattr(quantization, "AMX_ROWS_MAX", STEP_ROWS_MAX)
    model._cpu_step_layers_checked = False
    module_caches = _caches(model, cache_dtype)
    assert model._one_call_layers(rows, module_caches, meta) is None
    modules = model.hidden_states(ids, positions, module_caches, meta, logits_rows)
    return one_call, modules, one_call_caches, module_caches


def _assert_same_bits(one_call: torch.Tensor, modules: torch.Tensor, one_call_caches: list, module_caches: list) -> None:
    """The hidden states and every KV byte written, bit for bit."""
    assert torch.equal(one_call, modules)
    for (k1, v1), (k2, v2) in zip(one_call_caches, module_caches, strict=True):
        assert torch.equal(k1.view(torch.uint8), k2.view(torch.uint8))
        assert torch.equal(v1.view(torch.uint8), v2.view(torch.uint8))


amx = pytest.mark.skipif(not cpu_native.amx_linear_available(), reason="this CPU has no AMX tiles")
dot = pytest.mark.skipif(cpu_native.amx_linear_available() or not cpu_native.dot_linear_available(),
                         reason="the bf16 dot-product path serves CPUs with AVX-512 BF16 and no AMX")


def test_it_is_offered_exactly_where_the_projections_run_on_amx_or_bf16_dot_products() -> None:
    step = CpuStepLayers.for_model(_model())
    assert (step is not None) == (cpu_native.amx_linear_available() or cpu_native.dot_linear_available())
    if step is not None:
        assert step.rows_max == (STEP_ROWS_MAX if cpu_native.amx_linear_available() else DOT_ROWS_MAX)


@dot
@pytest.mark.parametrize("rows", [1, 5, DOT_ROWS_MAX])
@pytest.mark.parametrize(("bias", "cache_dtype"), [(False, torch.bfloat16), (True, torch.bfloat16),
                                                   (False, torch.float8_e4m3fn)],
                         ids=["bf16", "bf16-bias", "bf16-fp8-cache"])
def test_without_amx_the_step_is_the_same_bits_as_the_modules(rows: int, bias: bool, cache_dtype: torch.dtype,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    one_call, modules, one_call_caches, module_caches = _both_paths(_model(None, bias), rows, cache_dtype, monkeypatch)
    assert one_call.dtype == torch.bfloat16 and one_call.shape == (rows, 128)
    _assert_same_bits(one_call, modules, one_call_caches, module_caches)


@dot
def test_without_amx_a_step_past_the_dot_rows_or_with_a_prompt_runs_the_modules() -> None:
    model = _model()
    caches = _caches(model, torch.bfloat16)
    assert model._one_call_layers(DOT_ROWS_MAX, caches, _decode_step(DOT_ROWS_MAX)[2]) is not None
    assert model._one_call_layers(DOT_ROWS_MAX + 1, caches, _decode_step(DOT_ROWS_MAX + 1)[2]) is None
    assert model._one_call_layers(7, caches, _step([7])[2]) is None  # the prefill kernel is AMX's
    assert model._one_call_layers(4, _caches(model, torch.float32), _decode_step(4)[2]) is None


@amx
@pytest.mark.parametrize("rows", [1, 7, 33, AMX_ROWS_MAX, AMX_ROWS_MAX + 1])
@pytest.mark.parametrize(("quantization", "bias", "cache_dtype"), [
    (None, False, torch.bfloat16), (None, True, torch.bfloat16), ("int8", True, torch.bfloat16),
    (None, False, torch.float8_e4m3fn), ("int8", False, torch.float8_e5m2),
], ids=["bf16", "bf16-bias", "int8-bias", "bf16-fp8-cache", "int8-fp8-e5m2-cache"])
def test_the_step_is_the_same_bits_as_the_modules(rows: int, quantization: str | None, bias: bool,
                                                  cache_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    one_call, modules, one_call_caches, module_caches = _both_paths(
        _model(quantization, bias), rows, cache_dtype, monkeypatch)
    assert one_call.dtype == torch.bfloat16 and one_call.shape == (rows, 128)
    _assert_same_bits(one_call, modules, one_call_caches, module_caches)


@amx
@pytest.mark.parametrize("query_lens", [[7], [1, 9, 1, 1, 20, 1], [33, 1, 30], [100, *[1] * 30, 80, 46]],
                         ids=["prompt", "mixed", "64-rows", "256-rows"])
@pytest.mark.parametrize(("quantization", "cache_dtype"), [(None, torch.bfloat16), ("int8", torch.float8_e4m3fn)],
                         ids=["bf16", "int8-fp8-cache"])
def test_a_step_with_prompt_chunks_is_the_same_bits_as_the_modules(
        query_lens: list[int], quantization: str | None, cache_dtype: torch.dtype,
        monkeypatch: pytest.MonkeyPatch) -> None:
    step = _step(query_lens)
    rows = sum(query_lens)
    one_call, modules, one_call_caches, module_caches = _both_paths(
        _model(quantization, bias=True), rows, cache_dtype, monkeypatch, step)
    assert one_call.shape == (rows, 128)
    _assert_same_bits(one_call, modules, one_call_caches, module_caches)


@amx
def test_the_modules_run_what_it_does_not_cover() -> None:
    model = _model()
    caches = _caches(model, torch.bfloat16)
    meta = _step([200, 57])[2]
    assert model._one_call_layers(STEP_ROWS_MAX + 1, caches, meta) is None  # a prompt's rows oneDNN takes
    assert model._one_call_layers(4, _caches(model, torch.float32), _decode_step(4)[2]) is None
    assert CpuStepLayers.for_model(_model(qk_norm=True)) is None  # Qwen3's per-head norms


@amx
def test_a_slot_outside_the_cache_is_an_error_not_a_write() -> None:
    model = _model()
    ids, positions, meta = _decode_step(4)
    meta.slot_mapping = meta.slot_mapping.clone()
    meta.slot_mapping[2] = NUM_BLOCKS * BLOCK_SIZE
    caches = _caches(model, torch.bfloat16)
    before = [k.clone() for k, _ in caches]
    with pytest.raises(ValueError, match="outside the"):
        model.hidden_states(ids, positions, caches, meta, torch.arange(4))
    assert all(torch.equal(k, b) for (k, _), b in zip(caches, before, strict=True))


one_call_path = pytest.mark.skipif(not (cpu_native.amx_linear_available() or cpu_native.dot_linear_available()),
                                   reason="the one-call path needs AMX or AVX-512 BF16")


@one_call_path
def test_layers_run_in_checked_runs_are_the_same_bits_as_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Priority scheduling checks for a more urgent arrival between runs of layers
    (server/core/step_interrupt.py): the runs carry the residual stream, for the same bits."""
    model = _model()
    ids, positions, meta = _decode_step(4)
    rows = torch.arange(4)
    whole_caches = _caches(model, torch.bfloat16)
    whole = model.hidden_states(ids, positions, whole_caches, meta, rows)
    checks: list[int] = []
    model.one_call_check = lambda: checks.append(1)
    run_caches = _caches(model, torch.bfloat16)
    in_runs = model.hidden_states(ids, positions, run_caches, meta, rows)
    assert len(checks) == model.spec.num_layers  # 2 layers: a run each, a check before each
    _assert_same_bits(in_runs, whole, run_caches, whole_caches)


@one_call_path
def test_a_check_that_raises_stops_the_layers_before_the_next_run() -> None:
    model = _model()
    ids, positions, meta = _decode_step(2)
    caches = _caches(model, torch.bfloat16)
    untouched = [(k.clone(), v.clone()) for k, v in caches]

    class GivenUp(Exception):
        pass

    def check() -> None:
        if calls.append(1) or len(calls) == 2:
            raise GivenUp()

    calls: list[int] = []
    model.one_call_check = check
    with pytest.raises(GivenUp):
        model.hidden_states(ids, positions, caches, meta, torch.arange(2))
    # The first layer wrote its KV; the second never ran.
    assert not torch.equal(caches[0][0], untouched[0][0])
    assert torch.equal(caches[1][0], untouched[1][0]) and torch.equal(caches[1][1], untouched[1][1])
