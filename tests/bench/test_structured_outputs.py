"""The pure parts of bench/structured_outputs.py: its flags, vLLM's backend flags, the per-set
breakdown and the ratios against vLLM's best backend."""

from __future__ import annotations

import json

import pytest

from bench.structured_outputs import (
    build_parser,
    parse_baselines,
    per_set,
    ratios,
    vllm_backend_args,
)


def test_dtype_defaults_to_float32_so_old_commands_reproduce() -> None:
    assert build_parser().parse_args([]).dtype == "float32"
    assert build_parser().parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--dtype", "fp8"])


def test_baselines_name_vllm_backends() -> None:
    assert parse_baselines("vllm") == [("vllm", "auto")]
    assert parse_baselines("vllm,vllm:guidance") == [("vllm", "auto"), ("vllm-guidance", "guidance")]
    # vllm:auto is vllm; a repeat runs once
    assert parse_baselines("vllm:auto, vllm") == [("vllm", "auto")]
    assert parse_baselines("none") == [] and parse_baselines("") == []
    for bad in ("sglang", "vllm:llguidance", "sglang:guidance"):
        with pytest.raises(ValueError, match="unknown baseline"):
            parse_baselines(bad)


def test_vllm_backend_flags() -> None:
    # The default backend adds no flag: the earlier runs' vLLM command line is unchanged.
    assert vllm_backend_args("auto") == ()
    flag, value = vllm_backend_args("guidance")
    assert flag == "--structured-outputs-config" and json.loads(value) == {"backend": "guidance"}


def test_per_set_counts_each_outcome_and_coverage() -> None:
    rows = [{"set": "A", "outcome": "valid"}, {"set": "B", "outcome": "refused"}, {"set": "A", "outcome": "length"},
            {"set": "A", "outcome": "valid"}, {"set": "B", "outcome": "invalid"}, {"set": "B", "outcome": "http_500"}]
    sets = per_set(rows)
    assert list(sets) == ["A", "B"]
    assert sets["A"] == {"schemas": 3, "valid": 2, "length": 1, "refused": 0, "invalid": 0, "coverage": 2 / 3}
    assert sets["B"] == {"schemas": 3, "valid": 0, "length": 0, "refused": 1, "invalid": 1, "coverage": 0.0}


def _engine(coverage: float, tok_s: float) -> dict:
    return {"coverage": coverage, "constrained_tok_s": tok_s}


def test_ratios_compare_with_vllms_best_backend() -> None:
    engines = {"kvscale": _engine(0.6, 120.0), "vllm": _engine(0.5, 100.0), "vllm-guidance": _engine(0.4, 150.0)}
    result = ratios(engines)
    assert result["vllm_best"] == "vllm"
    assert result["coverage_over_vllm"] == pytest.approx(1.2)
    assert result["constrained_tok_s_over_vllm"] == pytest.approx(1.2)
    assert result["per_backend"]["vllm-guidance"]["coverage_over_vllm"] == pytest.approx(1.5)
    assert result["per_backend"]["vllm-guidance"]["constrained_tok_s_over_vllm"] == pytest.approx(0.8)
    # equal coverage: the faster backend is the best
    engines["vllm-guidance"]["coverage"] = 0.5
    assert ratios(engines)["vllm_best"] == "vllm-guidance"


def test_ratios_without_a_baseline_or_with_a_zero() -> None:
    assert ratios({"kvscale": _engine(0.5, 100.0)}) == {}
    result = ratios({"kvscale": _engine(0.5, 100.0), "vllm": _engine(0.0, 0.0)})
    assert result["coverage_over_vllm"] is None and result["constrained_tok_s_over_vllm"] is None
