"""The PyTorch references (the engine's CPU path) against dense attention over contiguous K/V."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_checks import (
    TOLERANCE,
    check_attention,
    dense_attention,
    make_case,
    max_error,
    random_case,
)

import kvscale.kernels as kernels
from kvscale.kernels import cpu_native, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(8))
def test_reference_decode_matches_dense(seed: int, dtype: torch.dtype) -> None:
    case = random_case(torch.Generator().manual_seed(seed), decode=True, dtype=dtype)
    out = reference.paged_decode_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale
    )
    assert out.shape == case.query.shape and out.dtype == dtype
    assert max_error(out, dense_attention(case)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(8))
def test_reference_prefill_matches_dense(seed: int, dtype: torch.dtype) -> None:
    case = random_case(torch.Generator().manual_seed(100 + seed), decode=False, dtype=dtype)
    out = reference.paged_prefill_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc,
        case.context_lens, case.scale,
    )
    assert out.shape == case.query.shape and out.dtype == dtype
    assert max_error(out, dense_attention(case)) <= TOLERANCE[dtype]


def test_reference_prefill_chunked_equals_whole_prompt() -> None:
    """A prompt prefilled in chunks gives the same outputs as the prompt in one go."""
    gen = torch.Generator().manual_seed(7)
    whole = make_case(gen, context_lens=[45], q_lens=[45], num_heads=6, num_kv_heads=2,
                      head_dim=32, block_size=8)
    out_whole = reference.paged_prefill_attention(
        whole.query, whole.k_cache, whole.v_cache, whole.block_tables, whole.query_start_loc,
        whole.context_lens, whole.scale,
    )
    pieces = []
    for start, end in [(0, 13), (13, 14), (14, 40), (40, 45)]:
        pieces.append(reference.paged_prefill_attention(
            whole.query[start:end], whole.k_cache, whole.v_cache, whole.block_tables,
            torch.tensor([0, end - start], dtype=torch.int32),
            torch.tensor([end], dtype=torch.int32), whole.scale,
        ))
    assert max_error(torch.cat(pieces), out_whole) <= 1e-6


def test_reference_decode_equals_prefill_of_one_token() -> None:
    case = random_case(torch.Generator().manual_seed(3), decode=True)
    decode = reference.paged_decode_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale
    )
    prefill = reference.paged_prefill_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc,
        case.context_lens, case.scale,
    )
    assert max_error(decode, prefill) <= 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_write_kv_stores_tokens_and_skips_minus_one(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    k_cache = torch.randn(4, 8, 2, 16, generator=gen).to(dtype)
    v_cache = torch.randn(4, 8, 2, 16, generator=gen).to(dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    key = torch.randn(5, 2, 16, generator=gen).to(dtype)
    value = torch.randn(5, 2, 16, generator=gen).to(dtype)
    slots = torch.tensor([9, -1, 31, 0, -1])
    reference.write_kv(key, value, k_cache, v_cache, slots)
    written = {9: 0, 31: 2, 0: 3}
    flat_k, flat_v = k_cache.view(32, 2, 16), v_cache.view(32, 2, 16)
    for slot in range(32):
        if slot in written:
            assert torch.equal(flat_k[slot], key[written[slot]])
            assert torch.equal(flat_v[slot], value[written[slot]])
        else:
            assert torch.equal(flat_k[slot], before_k.view(32, 2, 16)[slot])
            assert torch.equal(flat_v[slot], before_v.view(32, 2, 16)[slot])


def test_cpu_tensors_get_the_cpu_backend_unless_triton_is_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSCALE_FORCE_TRITON", raising=False)
    case = random_case(torch.Generator().manual_seed(5), decode=False)
    assert not kernels.use_triton(case.query.device)
    backend = kernels.backend_for(case.query.device)
    assert backend is cpu_native.CPU
    out = backend.paged_prefill_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc,
        case.context_lens, case.scale,
    )
    assert max_error(out, dense_attention(case)) <= TOLERANCE[torch.float32]
    monkeypatch.setenv("KVSCALE_FORCE_TRITON", "1")
    assert kernels.use_triton(case.query.device)


def test_the_reference_backend_is_the_reference_functions() -> None:
    backend = reference.REFERENCE
    assert backend.write_kv is reference.write_kv
    assert backend.paged_decode_attention is reference.paged_decode_attention
    assert backend.paged_prefill_attention is reference.paged_prefill_attention


def test_reference_rejects_bad_shapes() -> None:
    k_cache = torch.zeros(2, 8, 2, 16)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        reference.paged_decode_attention(
            torch.zeros(1, 3, 16), k_cache, k_cache, torch.zeros(1, 2, dtype=torch.int32),
            torch.tensor([4], dtype=torch.int32), 0.25,
        )
    with pytest.raises(ValueError, match="block table"):
        reference.paged_decode_attention(
            torch.zeros(1, 2, 16), k_cache, k_cache, torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([9], dtype=torch.int32), 0.25,
        )
    with pytest.raises(ValueError, match="slot_mapping"):
        reference.write_kv(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), k_cache, k_cache,
                           torch.zeros(2, dtype=torch.long))


def test_checks_catch_a_kernel_that_ignores_the_block_table() -> None:
    """The comparison harness must fail a kernel that reads the wrong blocks."""

    def identity_table_decode(query, k_cache, v_cache, block_tables, context_lens, scale):
        in_order = torch.arange(block_tables.numel(), dtype=torch.int32).view(block_tables.shape)
        return reference.paged_decode_attention(
            query, k_cache, v_cache, in_order % k_cache.shape[0], context_lens, scale
        )

    broken = SimpleNamespace(paged_decode_attention=identity_table_decode)
    result = check_attention(broken, torch.Generator().manual_seed(0), "decode", torch.float32,
                             "cpu")
    assert result["max_error"] > 100 * result["tolerance"]
    honest = check_attention(reference, torch.Generator().manual_seed(0), "decode",
                             torch.float32, "cpu")
    assert honest["max_error"] == 0.0


def test_reference_decode_of_empty_context_is_zero() -> None:
    """Padding sequences (context length 0) attend to nothing and yield zeros, not NaN."""
    case = random_case(torch.Generator().manual_seed(9), decode=True)
    lens = case.context_lens.clone()
    lens[0] = 0
    out = reference.paged_decode_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, lens, case.scale
    )
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert max_error(out[1:], dense_attention(case)[1:]) <= TOLERANCE[torch.float32]
    zeros = reference.paged_decode_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, lens * 0, case.scale
    )
    assert torch.equal(zeros, torch.zeros_like(zeros))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_prefill_batches_equal_chunks_and_matches_dense(dtype: torch.dtype) -> None:
    # Three chunks after a shared-length prefix (one batched call), two equal whole prompts
    # (another), a lone chunk and a decode token: every row must land where it belongs.
    case = make_case(torch.Generator().manual_seed(7), context_lens=[40, 40, 40, 25, 25, 33, 12],
                     q_lens=[8, 8, 8, 25, 25, 5, 1], num_heads=6, num_kv_heads=2, head_dim=32,
                     block_size=8, dtype=dtype)
    out = reference.paged_prefill_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc,
        case.context_lens, case.scale,
    )
    assert max_error(out, dense_attention(case)) <= TOLERANCE[dtype]
