"""The C prefill attention (bfloat16 on AMX, cpu_prefill_attention.c; float32 on AVX2 and FMA,
cpu_prefill_attention_f32.c) against dense attention."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import (
    TOLERANCE,
    cpu_has_amx_bf16,
    cpu_has_avx2_fma,
    dense_attention,
    make_case,
    max_error,
)

import kvscale.kernels as kernels
from kvscale.kernels import cpu_build, cpu_native, reference

pytestmark = pytest.mark.usefixtures("fresh_cpu_library")


def _attend(case):
    return cpu_native.paged_prefill_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                              case.query_start_loc, case.context_lens, case.scale)


def test_the_amx_path_is_there_exactly_where_the_cpu_has_amx() -> None:
    # The fast path must not vanish quietly on an AMX machine (a build or permission problem),
    # nor claim to run where the instructions do not exist.
    assert cpu_native.amx_prefill_available() == cpu_has_amx_bf16()


def test_the_float32_path_is_there_exactly_where_the_cpu_has_avx2_and_fma() -> None:
    assert cpu_native.f32_prefill_available() == cpu_has_avx2_fma()


# Each dtype a C kernel takes, with the dtype its outputs are judged in.
DTYPES = [torch.bfloat16, torch.float32]


# (context_lens, q_lens): whole prompts with tails of every size, chunks after a cached prefix,
# single-token decodes in the same batch, a query tile that straddles a 32-key step.
SHAPES = [
    ([2, 17, 33, 100], [2, 17, 33, 100]),
    ([300, 47, 5, 1000], [300, 40, 1, 64]),
    ([64, 65, 31, 16], [1, 65, 31, 2]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("groups", [(9, 3), (4, 4), (8, 1)], ids=lambda g: f"{g[0]}q{g[1]}kv")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "ctx" + "-".join(map(str, s[0])))
def test_prefill_matches_dense(dtype: torch.dtype, head_dim: int, groups: tuple[int, int], shape) -> None:
    context_lens, q_lens = shape
    case = make_case(torch.Generator().manual_seed(head_dim + groups[0]), context_lens=context_lens,
                     q_lens=q_lens, num_heads=groups[0], num_kv_heads=groups[1], head_dim=head_dim,
                     block_size=16, dtype=dtype)
    out = _attend(case)
    assert out.shape == case.query.shape and out.dtype == dtype
    assert max_error(out, dense_attention(case)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("head_dim", [40, 24, 12], ids=lambda d: f"d{d}")
def test_float32_heads_of_other_sizes_match_dense(head_dim: int) -> None:
    # 40 and 24: multiples of 8 but not 64 or 128, the float32 kernel's generic loops (5 and 3
    # vectors of value dims); 12: no kernel takes it, the reference does.
    case = make_case(torch.Generator().manual_seed(head_dim), context_lens=[70, 33], q_lens=[70, 17],
                     num_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=torch.float32)
    assert max_error(_attend(case), dense_attention(case)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_block_size_that_does_not_divide_a_key_step(dtype: torch.dtype) -> None:
    case = make_case(torch.Generator().manual_seed(5), context_lens=[77, 130], q_lens=[77, 50],
                     num_heads=6, num_kv_heads=2, head_dim=64, block_size=5, dtype=dtype)
    assert max_error(_attend(case), dense_attention(case)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_query_may_be_the_q_heads_of_the_fused_qk_rows(dtype: torch.dtype) -> None:
    # The model passes q as a view into [tokens, q heads + k heads, head_dim] (after RoPE).
    case = make_case(torch.Generator().manual_seed(6), context_lens=[90, 40], q_lens=[90, 20],
                     num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    fused = torch.cat([case.query, torch.full((case.query.shape[0], 3, 64), 7.0, dtype=dtype)], dim=1)
    view = fused[:, :9]
    assert not view.is_contiguous()
    out = cpu_native.paged_prefill_attention(view, case.k_cache, case.v_cache, case.block_tables,
                                             case.query_start_loc, case.context_lens, case.scale)
    assert torch.equal(out, _attend(case))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_bad_block_table_raises_instead_of_reading_out_of_bounds(dtype: torch.dtype) -> None:
    case = make_case(torch.Generator().manual_seed(7), context_lens=[40], q_lens=[40],
                     num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    outside = case.block_tables.clone()
    outside[0, 1] = case.k_cache.shape[0]
    with pytest.raises(ValueError, match="not a block of the"):
        cpu_native.paged_prefill_attention(case.query, case.k_cache, case.v_cache, outside,
                                           case.query_start_loc, case.context_lens, case.scale)
    short = case.block_tables[:, :2].contiguous()  # 40 tokens need 3 blocks of 16
    with pytest.raises(ValueError, match="more blocks than its block table row"):
        cpu_native.paged_prefill_attention(case.query, case.k_cache, case.v_cache, short,
                                           case.query_start_loc, case.context_lens, case.scale)


def test_the_cpu_backend_runs_each_where_its_cpu_has_the_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = cpu_build.library()
    assert lib is not None
    calls: list[str] = []
    for name in ("kvscale_paged_prefill_attention", "kvscale_paged_prefill_attention_f32"):
        real = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *args, name=name, real=real: calls.append(name) or real(*args))
    backend = kernels.backend_for(torch.device("cpu"))
    for dtype in (torch.bfloat16, torch.float32):
        case = make_case(torch.Generator().manual_seed(8), context_lens=[50, 20], q_lens=[30, 20], num_heads=9,
                         num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
        out = backend.paged_prefill_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                              case.query_start_loc, case.context_lens, case.scale)
        assert max_error(out, dense_attention(case)) <= TOLERANCE[dtype]
    # bfloat16 through the AMX kernel, float32 through the AVX2 one; elsewhere through SDPA.
    expected = (["kvscale_paged_prefill_attention"] if cpu_has_amx_bf16() else []) + (
        ["kvscale_paged_prefill_attention_f32"] if cpu_has_avx2_fma() else [])
    assert calls == expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sequences_sharing_prefix_blocks_match_the_reference(dtype: torch.dtype) -> None:
    # Requests after a common prefix point at the same blocks (prefix caching); the kernel packs
    # those keys once. Sequence 1 shares 4 blocks (64 tokens) with sequence 0, sequence 2 shares
    # 3 (48 tokens: its second 32-key step is half shared) and sequence 3 shares all of
    # sequence 0's blocks but has fewer keys than they hold.
    gen = torch.Generator().manual_seed(9)
    num_blocks, block_size, kv_heads, head_dim = 40, 16, 3, 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.tensor([[7, 3, 20, 11, 5, 30, 31],
                           [7, 3, 20, 11, 8, 9, -1],
                           [7, 3, 20, 12, 13, -1, -1],
                           [7, 3, 20, 11, 5, 30, 31]], dtype=torch.int32)
    context_lens = torch.tensor([100, 90, 70, 97], dtype=torch.int32)
    q_lens = [100, 26, 22, 2]
    starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    query = torch.randn(sum(q_lens), 9, head_dim, generator=gen).to(dtype)
    args = (query, k_cache, v_cache, tables, starts, context_lens, head_dim**-0.5)
    out = cpu_native.paged_prefill_attention(*args)
    expected = reference.paged_prefill_attention(query.float(), k_cache.float(), v_cache.float(), *args[3:])
    assert max_error(out, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_batch_of_single_tokens_only_goes_to_the_decode_kernel(dtype: torch.dtype) -> None:
    case = make_case(torch.Generator().manual_seed(10), context_lens=[5, 40, 17], q_lens=[1, 1, 1],
                     num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    assert max_error(_attend(case), dense_attention(case)) <= TOLERANCE[dtype]


def test_tasks_of_very_different_lengths_match_dense() -> None:
    # Tasks run longest first on threads that reuse their packing buffers: a short sequence after
    # a long one packs over the long one's keys, and a 2-token chunk follows a 300-token context.
    case = make_case(torch.Generator().manual_seed(11), context_lens=[1000, 21, 3, 300], q_lens=[40, 21, 3, 2],
                     num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
    assert max_error(_attend(case), dense_attention(case)) <= TOLERANCE[torch.float32]
