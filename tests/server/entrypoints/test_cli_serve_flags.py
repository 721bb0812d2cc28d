"""`kvscale serve` flags refused before anything starts (no model load, no engine core)."""

from __future__ import annotations

import json

import pytest

from kvscale.cli import build_parser
from kvscale.server.entrypoints.cli_serve import run


def test_a_stream_interval_below_one_is_refused_before_anything_starts(capsys):
    assert run(build_parser("serve").parse_args(["serve", "--stream-interval", "0"])) == 2
    assert "--stream-interval must be at least 1" in capsys.readouterr().err
    assert build_parser("serve").parse_args(["serve"]).stream_interval == 1


def test_the_help_names_every_model_family_the_engine_loads(capsys):
    from kvscale.server.worker.model_config import FAMILY_DEFAULTS

    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for family in FAMILY_DEFAULTS:
        assert family in help_text, family


def test_tensor_parallel_size_reaches_the_engine_config_and_zero_is_refused(capsys):
    args = build_parser("serve").parse_args(["serve", "--tensor-parallel-size", "3"])
    assert args.tensor_parallel_size == 3
    assert run(build_parser("serve").parse_args(["serve", "--tensor-parallel-size", "0"])) == 2
    assert "tensor_parallel_size must be at least 1" in capsys.readouterr().err


def test_speculative_config_takes_ngram_and_refuses_other_methods_by_name(capsys):
    args = build_parser("serve").parse_args(["serve", "--speculative-config", json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2})])
    assert (args.speculative_config.num_speculative_tokens, args.speculative_config.prompt_lookup_max,
            args.speculative_config.prompt_lookup_min) == (3, 4, 2)
    suffix = build_parser("serve").parse_args(["serve", "--speculative-config", '{"method": "suffix"}'])
    assert suffix.speculative_config.method == "suffix"
    draft_model = {"method": "eagle", "model": "some/draft", "num_speculative_tokens": 3}
    for refused in (draft_model, {"method": "eagle", "num_speculative_tokens": 3}, {"method": "ngram"},
                    {"method": "suffix", "suffix_decoding_max_tree_depth": 100}):
        with pytest.raises(SystemExit) as exit_info:
            build_parser("serve").parse_args(["serve", "--speculative-config", json.dumps(refused)])
        assert exit_info.value.code == 2
        assert "--speculative-config cannot be honoured" in capsys.readouterr().err
