"""bench.lora's pure parts: the Zipf stream, the replay of a replica's LoRA slots that counts the
router's hits, the mixed batch's adapters and the figures against their targets."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.lora import baseline_note, figures, parse_args
from bench.lora_engine import mixed_names
from bench.lora_router import device_pool_hits, zipf_adapters
from bench.lora_vllm import rotated, summarize, vllm_spec
from bench.w1_throughput import workload


def test_zipf_draws_the_first_adapters_most_and_repeats_with_its_seed() -> None:
    names = [f"a{i:02d}" for i in range(24)]
    stream = zipf_adapters(names, 2000, 1.0, seed=3)
    counts = Counter(stream)
    assert counts["a00"] > 1.5 * counts["a01"] and counts["a01"] > counts["a05"] > counts["a23"]
    assert counts["a00"] / 2000 > 0.2  # 1 / H(24) = 0.26
    assert zipf_adapters(names, 50, 1.0, seed=3) == stream[:50]
    assert zipf_adapters(names, 50, 1.0, seed=4) != stream[:50]


def test_a_replicas_slots_are_least_recently_used_first_out() -> None:
    served = [("r0", "x"), ("r0", "a"), ("r0", "b"), ("r0", "x"), ("r0", "c"), ("r0", "a"), ("r1", "a")]
    hits, after = device_pool_hits(served, slots=2, initial={"r0": ["f"], "r1": ["f", "a"]})
    # r0: x miss (f x), a miss (x a), b miss (a b), x miss (b x), c miss (x c), a miss; r1 holds a.
    assert hits == [False, False, False, False, False, False, True]
    assert after == {"r0": ["c", "a"], "r1": ["f", "a"]}
    hits, after = device_pool_hits([("r0", "a"), ("r0", "b"), ("r0", "a"), ("r0", "c"), ("r0", "b")], 2, {})
    assert hits == [False, False, True, False, False]  # c evicted b, the least recently used
    assert after == {"r0": ["c", "b"]}


def test_a_mixed_batch_names_every_adapter_in_turn() -> None:
    assert mixed_names(5, ["a", "b", "c"]) == ["a", "b", "c", "a", "b"]


def test_a_figure_is_met_only_at_or_above_its_target_and_reported_without_one() -> None:
    engine = {"mixed_over_base_median": 0.79, "tok_s_median": {"base": 100.0, "base_on_lora_engine": 95.0,
                                                                "mixed": 79.0}}
    peft = {"tok_s": {"base": 50.0, "mixed": 25.0}}
    out = figures(engine, peft, {"ttft_ms_median": {"warm": 40.0}}, {"default_over_round_robin": 2.0})
    assert out["mixed_over_base"] == {"value": 0.79, "target": 0.8, "met": False}
    assert out["mixed_over_peft"]["value"] == 79.0 / 25.0 and out["mixed_over_peft"]["met"] is True
    assert out["router_hit_rate_over_round_robin"]["met"] is True
    assert out["ttft_ms_warm"] == {"value": 40.0, "target": None, "met": None}
    assert "mixed_over_peft" not in figures(engine, None, None, None)


def test_the_earlier_trees_engine_side_gives_its_own_ratio_and_the_mixed_speedup() -> None:
    engine = {"mixed_over_base_median": 0.8, "tok_s_median": {"base": 100.0, "base_on_lora_engine": 95.0, "mixed": 80.0}}
    before = {"mixed_over_base_median": 0.6, "tok_s_median": {"base": 100.0, "base_on_lora_engine": 95.0, "mixed": 60.0}}
    out = figures(engine, None, None, None, before)
    assert out["mixed_over_base_before"] == {"value": 0.6, "target": None, "met": None}
    assert out["mixed_tok_s_over_before"]["value"] == 80.0 / 60.0
    assert "mixed_over_base_before" not in figures(engine, None, None, None)


def test_the_sides_get_the_command_line_without_the_flags_an_earlier_tree_lacks() -> None:
    from bench.common import strip_flags

    argv = ["--rounds", "2", "--before-checkout", "/tmp/b", "--out=/tmp/o.json", "--parts", "engine"]
    assert strip_flags(argv, ("--before-checkout", "--out")) == ["--rounds", "2", "--parts", "engine"]


ENGINE = {"mixed_over_base_median": 0.9, "tok_s_median": {"base": 100.0, "base_on_lora_engine": 100.0, "mixed": 90.0}}
PEFT = {"tok_s": {"base": 50.0, "mixed": 30.0}}


def test_vllms_side_carries_the_baseline_target_and_peft_keeps_its_ratio_without_one() -> None:
    vllm = {"kvscale_mixed_over_vllm_mixed_median": 1.1, "vllm_mixed_over_vllm_base_median": 0.8,
            "vllm_version": "0.32.0", "dtype": "float32"}
    out = figures(ENGINE, PEFT, None, None, vllm=vllm)
    assert out["mixed_over_vllm"] == {"value": 1.1, "target": 1.2, "met": False}
    assert out["vllm_mixed_over_vllm_base"]["value"] == 0.8
    assert out["mixed_over_peft"] == {"value": 3.0, "target": None, "met": None}
    assert "mixed_over_vllm" in baseline_note(vllm, None)


def test_where_vllm_refuses_peft_carries_the_target_and_the_note_quotes_vllms_error() -> None:
    refused = {"refused": "ValueError: LoRA is not supported on CPU"}
    out = figures(ENGINE, PEFT, None, None, vllm=refused)
    assert "mixed_over_vllm" not in out
    assert out["mixed_over_peft"] == {"value": 3.0, "target": 1.2, "met": True}
    assert "LoRA is not supported on CPU" in baseline_note(refused, None)
    assert "crashed" in baseline_note(None, "vLLM's LoRA side failed: crashed")


def test_vllms_requests_are_the_engine_sides_with_the_same_adapters_and_limits() -> None:
    args = parse_args(["--num-requests", "5", "--rounds", "2", "--dtype", "bfloat16"])
    adapters = {"a00": "/x/a00", "a01": "/x/a01"}
    spec = vllm_spec(args, adapters, "/m")
    prompts, outputs = workload(args)
    assert spec["prompts"] == prompts and spec["max_tokens"] == outputs and spec["rounds"] == 2
    assert spec["names"] == mixed_names(5, ["a00", "a01"])
    assert spec["llm"]["model"] == "/m"
    assert (spec["llm"]["dtype"], spec["llm"]["max_loras"], spec["llm"]["max_lora_rank"],
            spec["llm"]["max_num_seqs"]) == ("bfloat16", 2, args.rank, 5)
    assert spec["llm"]["enable_lora"] is True
    too_long = parse_args(["--num-requests", "2", "--min-prompt", "2040", "--max-prompt", "2040"])
    with pytest.raises(ValueError, match="max_model_len"):
        vllm_spec(too_long, adapters, "/m")


def test_vllms_summary_pairs_each_rounds_passes_and_splits_a_pass_into_prefill_and_decode() -> None:
    passes = {"kvscale_mixed": [200.0, 100.0, 150.0], "vllm_mixed": [100.0, 40.0, 50.0],
              "vllm_base_on_lora_engine": [200.0, 50.0, 80.0]}
    out = summarize(passes, {"kvscale_mixed": 0.5, "vllm_mixed": 2.0, "vllm_base_on_lora_engine": 1.0},
                    useful_tokens=400)
    assert out["kvscale_mixed_over_vllm_mixed_paired"] == [2.0, 2.5, 3.0]
    assert out["kvscale_mixed_over_vllm_mixed_median"] == 2.5  # not 150 / 50, the medians' ratio
    assert out["vllm_mixed_over_vllm_base_median"] == 0.625
    assert out["decode_s"]["vllm_mixed"] == 400 / 50.0 - 2.0


def test_each_round_starts_one_side_later() -> None:
    sides = ["k", "v", "b"]
    assert [rotated(sides, r) for r in range(4)] == [["k", "v", "b"], ["v", "b", "k"], ["b", "k", "v"],
                                                    ["k", "v", "b"]]
