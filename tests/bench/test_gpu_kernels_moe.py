"""bench/gpu_kernels_moe.py's parts that need no GPU: its token counts, the bytes and multiply-adds
its figures divide by, and its refusal to write figures on a machine without CUDA."""

from __future__ import annotations

import pytest
import torch

from bench.gpu_kernels_moe import (
    QUICK_TOKENS,
    QWEN3_30B_A3B,
    TOKENS,
    MoeLayer,
    expert_bytes_read,
    main,
    multiply_adds,
    parse_args,
    token_counts,
)


def test_token_counts_from_the_flags() -> None:
    assert token_counts("", quick=False) == TOKENS and token_counts("", quick=True) == QUICK_TOKENS
    assert token_counts("1, 64,2048", quick=True) == [1, 64, 2048]
    assert parse_args(["--quick", "--tokens", "8"]).tokens == "8"
    for bad in ("0", "1,-4", ","):
        with pytest.raises(ValueError):
            parse_args(["--tokens", bad])


def test_the_layer_is_qwen3_30b_a3b_shaped() -> None:
    assert (QWEN3_30B_A3B.hidden, QWEN3_30B_A3B.experts, QWEN3_30B_A3B.top_k, QWEN3_30B_A3B.inter) == (2048, 128, 8, 768)
    assert QWEN3_30B_A3B.expert_params() == 3 * 2048 * 768


def test_bytes_count_each_chosen_expert_once_and_work_each_pair() -> None:
    layer = MoeLayer(hidden=4, experts=8, top_k=2, inter=3)
    ids = torch.tensor([[0, 5], [5, 0], [7, 1]])  # experts 0, 1, 5, 7
    assert expert_bytes_read(ids, layer, elem=2) == 4 * 36 * 2
    assert multiply_adds(3, layer) == 3 * 2 * 36


def test_without_cuda_it_refuses_and_writes_nothing(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the refusal, on any machine
    out = tmp_path / "moe.json"
    assert main(["--quick", "--out", str(out)]) == 2
    assert not out.exists() and "No GPU figures were measured" in capsys.readouterr().err
