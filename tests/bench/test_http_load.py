"""The pure parts of bench.http_load, its sides and its servers: baselines, side order, ratios,
the `kvscale serve` command."""

from __future__ import annotations

import argparse
import math

import pytest

from bench.http_load import compare, parse_baselines, round_order
from bench.http_load_sides import make_workload
from bench.http_servers import kvscale_argv, resolved_dtype
from kvscale.server.entrypoints.cli_serve import add_arguments


def test_parse_baselines_keeps_order_and_rejects_unknown_or_repeated():
    assert parse_baselines("vllm,offline") == ["vllm", "offline"]
    assert parse_baselines(" vllm ") == ["vllm"]
    assert parse_baselines("") == []
    with pytest.raises(ValueError, match="vlm"):
        parse_baselines("offline,vlm")
    with pytest.raises(ValueError, match="twice"):
        parse_baselines("vllm,vllm")


def test_round_order_alternates_two_sides():
    sides = ["kvscale", "vllm"]
    assert [round_order(sides, r) for r in range(3)] == [
        ["kvscale", "vllm"], ["vllm", "kvscale"], ["kvscale", "vllm"]]


def test_round_order_puts_every_side_first_once_per_cycle():
    sides = ["kvscale", "offline", "vllm"]
    orders = [round_order(sides, r) for r in range(3)]
    assert [order[0] for order in orders] == sides
    assert all(sorted(order) == sorted(sides) for order in orders)


def test_compare_is_kvscale_over_baseline():
    kvscale = {"output_tokens_per_s": 30.0, "ttft_s": {"p50": 2.0, "p99": 6.0}, "itl_s": {"p50": 0.5, "p99": 1.0}}
    vllm = {"output_tokens_per_s": 20.0, "ttft_s": {"p50": 4.0, "p99": 3.0}, "itl_s": {"p50": 0.25, "p99": 2.0}}
    assert compare(kvscale, vllm) == {"throughput": 1.5, "ttft_p50": 0.5, "ttft_p99": 2.0,
                                      "itl_p50": 2.0, "itl_p99": 0.5}


def test_compare_skips_latencies_the_baseline_did_not_measure():
    kvscale = {"output_tokens_per_s": 9.0, "ttft_s": {"p50": 1.0, "p99": 2.0}, "itl_s": {"p50": 0.1, "p99": 0.2}}
    offline = {"output_tokens_per_s": 10.0, "ttft_s": {"p50": 0.5, "p99": 1.0}}
    ratios = compare(kvscale, offline)
    assert set(ratios) == {"throughput", "ttft_p50", "ttft_p99"}
    assert math.isclose(ratios["throughput"], 0.9)


def test_workload_is_reproducible_and_within_bounds():
    a = make_workload(8, (4, 10), (2, 5), seed=3, vocab_size=1000)
    assert a == make_workload(8, (4, 10), (2, 5), seed=3, vocab_size=1000)
    assert a != make_workload(8, (4, 10), (2, 5), seed=4, vocab_size=1000)
    assert all(4 <= len(p) <= 10 and all(100 <= t < 1000 for t in p) for p in a.prompts)
    assert all(2 <= n <= 5 for n in a.output_lens)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_kvscale_argv_is_what_kvscale_serve_parses_back(prefix_caching):
    flags = {"dtype": "float32", "max_model_len": 336, "max_num_seqs": 32, "max_num_batched_tokens": 2048,
             "kv_cache_memory_bytes": 2 * 1024**3, "enable_prefix_caching": prefix_caching, "block_size": 16,
             "device": "cpu"}
    argv = kvscale_argv(flags, 8123, "SmolLM2-135M-Instruct")
    assert argv[1:4] == ["-m", "kvscale", "serve"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = parser.parse_args(argv[4:])
    assert {name: getattr(parsed, name) for name in flags} == flags
    assert parsed.served_model_name == ["SmolLM2-135M-Instruct"]
    assert (parsed.host, parsed.port) == ("127.0.0.1", 8123)


def test_resolved_dtype_reads_either_servers_log():
    kvscale_log = "INFO kvscale.server.worker.model_loader: --dtype auto on AMD EPYC: float32, because no native bf16\n"
    vllm_log = "INFO [llm_engine.py] Initializing a V1 LLM engine with config: model='m', dtype=torch.bfloat16, x=1\n"
    assert resolved_dtype(kvscale_log) == "float32"
    assert resolved_dtype(vllm_log) == "bfloat16"
    assert resolved_dtype("INFO started\n") is None
