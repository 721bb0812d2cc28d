"""The FP8 KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) in the C kernels and the reference.

Writes must equal torch's own saturating round-to-nearest-even cast bit for bit; the C decode and
prefill attention must match the PyTorch reference on random paged cases (scales other than 1
included); the reference must match dense float64 attention over the dequantized K/V, so the
pair cannot agree on something wrong; every FP8 code must widen exactly.
"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import TOLERANCE, PagedCase, dense_attention, make_case, max_error, random_case

from kvscale.kernels import cpu_build, cpu_native, fp8, reference

pytestmark = pytest.mark.usefixtures("fresh_cpu_library")

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
SCALES = [(1.0, 1.0), (0.37, 2.5)]


def _quantized(case: PagedCase, dtype: torch.dtype, k_scale: float, v_scale: float) -> PagedCase:
    """The case with its caches in FP8 and its dense K/V as the cache now holds them."""
    case.k_cache = fp8.quantize(case.k_cache, dtype, k_scale)
    case.v_cache = fp8.quantize(case.v_cache, dtype, v_scale)
    case.dense_k = [fp8.dequantize(fp8.quantize(k, dtype, k_scale), k_scale) for k in case.dense_k]
    case.dense_v = [fp8.dequantize(fp8.quantize(v, dtype, v_scale), v_scale) for v in case.dense_v]
    return case


def _hard_values(gen: torch.Generator, num_tokens: int, source: torch.dtype) -> torch.Tensor:
    """K/V rows spanning every binade FP8 has and past both ends: subnormals, values that round
    up into the next binade or to the largest finite value, overflow, infinities and NaN."""
    magnitudes = torch.logspace(-24, 20, num_tokens, base=2)[:, None, None]
    rows = torch.randn(num_tokens, 3, 64, generator=gen) * magnitudes
    rows[0, 0, :8] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 449.0, 57344.0])
    rows[1, 0, :4] = torch.tensor([0.0, -0.0, 2.0**-10, -(2.0**-17)])
    return rows.to(source)


@pytest.mark.parametrize("dtype", FORMATS, ids=str)
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES + [(4.0, 0.1)])
def test_writes_equal_torchs_saturating_cast_bit_for_bit(dtype, source, k_scale, v_scale) -> None:
    gen = torch.Generator().manual_seed(0)
    key = _hard_values(gen, 50, source)
    value = key.flip(0).contiguous()
    slots = torch.randperm(80, generator=gen)[:50]
    slots[3] = -1  # not stored
    native = [torch.zeros(10, 8, 3, 64, dtype=dtype) for _ in range(2)]
    ref = [torch.zeros(10, 8, 3, 64, dtype=dtype) for _ in range(2)]
    cpu_native.write_kv(key, value, *native, slots, k_scale=k_scale, v_scale=v_scale)
    reference.write_kv(key, value, *ref, slots, k_scale=k_scale, v_scale=v_scale)
    for got, want in zip(native, ref, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # The reference itself: torch's cast of the clamped quotient, and finite where x is.
    limit = torch.finfo(dtype).max
    expected = (key.float() / k_scale).clamp(-limit, limit).to(dtype)
    stored = native[0].view(80, 3, 64)[slots[slots >= 0]]
    assert torch.equal(stored.view(torch.uint8), expected[slots >= 0].view(torch.uint8))
    assert torch.isfinite(stored.float()[torch.isfinite(key[slots >= 0].float())]).all()
    untouched = torch.ones(80, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert not native[0].view(80, 3, 64)[untouched].view(torch.uint8).any()


def test_a_slot_outside_an_fp8_cache_raises_and_writes_nothing() -> None:
    k_cache = torch.zeros(2, 4, 1, 16, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    key = value = torch.ones(2, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="outside the 8-slot cache"):
        cpu_native.write_kv(key, value, k_cache, v_cache, torch.tensor([1, 8]))
    assert not k_cache.view(torch.uint8).any() and not v_cache.view(torch.uint8).any()


@pytest.mark.parametrize("dtype", FORMATS, ids=str)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
@pytest.mark.parametrize("seed", range(6))
def test_decode_matches_the_reference_and_dense_attention(dtype, query_dtype, k_scale, v_scale, seed) -> None:
    case = _quantized(random_case(torch.Generator().manual_seed(seed), decode=True, dtype=query_dtype),
                      dtype, k_scale, v_scale)
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale)
    native = cpu_native.paged_decode_attention(*args, k_scale=k_scale, v_scale=v_scale)
    ref = reference.paged_decode_attention(*args, k_scale=k_scale, v_scale=v_scale)
    assert native.dtype == query_dtype and native.shape == case.query.shape
    assert max_error(native, ref) <= TOLERANCE[query_dtype]
    assert max_error(ref, dense_attention(case)) <= TOLERANCE[query_dtype]


@pytest.mark.parametrize("dtype", FORMATS, ids=str)
@pytest.mark.parametrize("num_seqs", [3, 40], ids=lambda n: f"{n}seqs")
def test_decode_on_the_models_shape_matches_the_reference(dtype, num_seqs) -> None:
    # The bundled model's heads (9 query / 3 KV of 64), both task shapes, bf16 dots and float32.
    gen = torch.Generator().manual_seed(num_seqs)
    lens = torch.randint(1, 300, (num_seqs,), generator=gen).tolist()
    for query_dtype in (torch.bfloat16, torch.float32):
        case = _quantized(make_case(gen, context_lens=lens, q_lens=[1] * num_seqs, num_heads=9, num_kv_heads=3,
                                    head_dim=64, block_size=16, dtype=query_dtype), dtype, 0.5, 2.0)
        args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale)
        native = cpu_native.paged_decode_attention(*args, k_scale=0.5, v_scale=2.0)
        ref = reference.paged_decode_attention(*args, k_scale=0.5, v_scale=2.0)
        assert max_error(native, ref) <= (TOLERANCE[query_dtype] if query_dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", FORMATS, ids=str)
def test_nan_codes_past_a_context_never_reach_the_decode_output(dtype) -> None:
    # On AMX CPUs an FP8 tile is widened whole (16 keys, the block's stale slots past a context
    # included) before its tile products: their scores must be dropped and their values zeroed.
    lens = [1, 15, 17, 33, 200]
    case = _quantized(make_case(torch.Generator().manual_seed(3), context_lens=lens, q_lens=[1] * len(lens),
                                num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16),
                      dtype, 0.5, 2.0)
    for seq, context in enumerate(lens):
        last_block = int(case.block_tables[seq, (context - 1) // 16])
        for cache in (case.k_cache, case.v_cache):
            cache.view(torch.uint8)[last_block, (context - 1) % 16 + 1:] = 0x7F  # NaN in both formats
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale)
    native = cpu_native.paged_decode_attention(*args, k_scale=0.5, v_scale=2.0)
    assert torch.isfinite(native).all()
    assert max_error(native, dense_attention(case)) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("dtype", FORMATS, ids=str)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_fp8_code_widens_exactly(dtype, query_dtype) -> None:
    # A context of one token attends with weight 1: the output is that token's V row, so each of
    # the 64 codes in each row must come out as exactly its value times the scale (NaN codes and
    # e5m2's infinities aside: nothing the saturating write stores).
    raw = torch.arange(256, dtype=torch.uint8)
    raw = raw[torch.isfinite(raw.view(dtype).float())]
    raw = torch.cat([raw, raw[: (-len(raw)) % 64]]).view(-1, 1, 64)  # whole rows of 64
    num_seqs = raw.shape[0]
    codes = raw.view(dtype)
    v_cache = raw.view(num_seqs, 1, 1, 64).expand(num_seqs, 16, 1, 64).contiguous().view(dtype)
    k_cache = torch.zeros_like(v_cache)
    query = torch.randn(num_seqs, 2, 64).to(query_dtype)
    tables = torch.arange(num_seqs, dtype=torch.int32)[:, None]
    lens = torch.ones(num_seqs, dtype=torch.int32)
    out = cpu_native.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125, v_scale=0.5)
    expected = (fp8.dequantize(codes, 0.5).expand(num_seqs, 2, 64)).to(query_dtype)
    assert torch.equal(out, expected)


# (context_lens, q_lens): whole prompts, chunks after a cached prefix, decodes in the same batch.
PREFILL_SHAPES = [
    ([2, 17, 33, 100], [2, 17, 33, 100]),
    ([300, 47, 5, 200], [300, 40, 1, 64]),
]


@pytest.mark.parametrize("dtype", FORMATS, ids=str)
@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
@pytest.mark.parametrize("shape", range(len(PREFILL_SHAPES)))
def test_prefill_matches_the_reference_and_dense_attention(dtype, k_scale, v_scale, shape) -> None:
    # bfloat16 queries and head_dim 64: the AMX kernel where the CPU has it (which packs the FP8
    # cache to bfloat16 as the reference dequantizes it for its SDPA).
    context_lens, q_lens = PREFILL_SHAPES[shape]
    case = _quantized(make_case(torch.Generator().manual_seed(shape), context_lens=context_lens, q_lens=q_lens,
                                num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16),
                      dtype, k_scale, v_scale)
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc, case.context_lens,
            case.scale)
    native = cpu_native.paged_prefill_attention(*args, k_scale=k_scale, v_scale=v_scale)
    ref = reference.paged_prefill_attention(*args, k_scale=k_scale, v_scale=v_scale)
    assert max_error(native, ref) <= TOLERANCE[torch.bfloat16]
    assert max_error(ref, dense_attention(case)) <= TOLERANCE[torch.bfloat16]


def test_the_fp8_prefill_runs_in_c_where_the_bfloat16_one_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # The FP8 cache must not quietly send prefill back to the PyTorch reference where a bfloat16
    # cache's prefill runs in C (an AMX CPU); elsewhere both take the reference.
    lib = cpu_build.library()
    assert lib is not None
    calls: list[int] = []
    real = lib.kvscale_paged_prefill_attention
    monkeypatch.setattr(lib, "kvscale_paged_prefill_attention", lambda *a: calls.append(a[14]) or real(*a))
    for dtype in (torch.bfloat16, torch.float8_e5m2):
        case = make_case(torch.Generator().manual_seed(9), context_lens=[40, 70], q_lens=[40, 30],
                         num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16)
        if dtype != torch.bfloat16:
            case = _quantized(case, dtype, 1.0, 1.0)
        cpu_native.paged_prefill_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                           case.query_start_loc, case.context_lens, case.scale)
    expected = [fp8.cache_format(torch.bfloat16), fp8.cache_format(torch.float8_e5m2)]
    assert calls == (expected if cpu_native.amx_prefill_available() else [])


def test_the_triton_kernels_refuse_an_fp8_cache() -> None:
    from kvscale.kernels.triton_kernels import TRITON

    case = _quantized(make_case(torch.Generator().manual_seed(1), context_lens=[5], q_lens=[1], num_heads=2,
                                num_kv_heads=1, head_dim=16, block_size=8), torch.float8_e4m3fn, 1.0, 1.0)
    key = torch.zeros(1, 1, 16)
    with pytest.raises(NotImplementedError, match="FP8"):
        TRITON.write_kv(key, key, case.k_cache, case.v_cache, torch.tensor([0]))
    with pytest.raises(NotImplementedError, match="FP8"):
        TRITON.paged_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                      case.context_lens, case.scale)
    with pytest.raises(NotImplementedError, match="FP8"):
        TRITON.paged_prefill_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                       case.query_start_loc, case.context_lens, case.scale)
