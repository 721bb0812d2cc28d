"""``--dtype auto`` (server/worker/model_loader.py): bf16 on CPUs that multiply bf16 in hardware and
whose oneDNN has kernels for it, fp32 elsewhere, the choice and its reason logged."""

from __future__ import annotations

import logging

import torch

from kvscale.server.worker.cpu_features import cpu_features
from kvscale.server.worker.model_loader import auto_cpu_dtype, resolve_dtype


def test_auto_cpu_dtype_decision() -> None:
    assert auto_cpu_dtype(native_bf16=True, onednn_bf16=True)[0] == "bfloat16"
    dtype, why = auto_cpu_dtype(native_bf16=False, onednn_bf16=True)
    assert dtype == "float32" and "no native bf16" in why
    dtype, why = auto_cpu_dtype(native_bf16=True, onednn_bf16=False)
    assert dtype == "float32" and "oneDNN" in why


def test_auto_on_this_cpu_is_the_decision_and_is_logged(caplog) -> None:
    onednn_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    expected, why = auto_cpu_dtype(cpu_features().native_bf16, onednn_bf16)
    with caplog.at_level(logging.INFO, logger="kvscale.server.worker.model_loader"):
        assert resolve_dtype("auto", None, torch.device("cpu")) == getattr(torch, expected)
    assert f"{expected}, because {why}" in caplog.text
    # An explicit dtype is taken as given, whatever the CPU.
    assert resolve_dtype("float32", None, torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", None, torch.device("cpu")) == torch.bfloat16
