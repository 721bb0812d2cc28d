"""The real runs' share of the ceiling (bench/w3_router.py) and their estimate's error
(bench/w3_fleet_ceiling.py), on plain values and the bundled tokenizer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.w3_ceilings import capacity_ceiling
from bench.w3_fleet_ceiling import prediction_error
from bench.w3_router_report import run_ceiling
from bench.w3_workloads import Workload, build_workload

W3 = dict(groups=8, prefix_tokens=128, suffix_tokens=16, requests=64, output_tokens=4, concurrency=8, seed=0)
ARGS = SimpleNamespace(block_size=16, replicas=4, num_gpu_blocks_override=48)


@pytest.fixture(scope="module")
def tokenizer():
    from kvscale.model_files import load_tokenizer, resolve_tokenizer_path

    return load_tokenizer(resolve_tokenizer_path(None))


def test_a_w3_runs_ceiling_is_the_simulators_on_the_prompts_it_sent_in_their_order(tokenizer) -> None:
    workload = build_workload("w3", W3, 0)
    prompts = [prompt for client in workload.clients for _, prompt, _, _ in client]
    # Sent in reverse of that list, and one failed request: only what was sent, in the order sent.
    results = [{"ok": True, "sent_at": -i, "prompt_ids": p, "output_tokens": 4} for i, p in enumerate(prompts)]
    results.append({"ok": False, "status": 500})
    sent = Workload([[(0.0, p, [], 4) for p in reversed(prompts)]])
    assert run_ceiling(ARGS, results, tokenizer) == pytest.approx(capacity_ceiling(sent, 16, 4 * 48))
    # Every group's first request misses; with the fleet's 192 blocks every prefix fits.
    assert run_ceiling(ARGS, results, tokenizer) == pytest.approx((64 - 8) / 64 * 128 / 144)


def test_a_chat_runs_ceiling_reuses_a_turns_prompt_and_its_answer(tokenizer) -> None:
    from kvscale.tokenization import chat_prompt_token_ids

    first = [{"role": "user", "content": "Summarise the lighthouse keeper's log " * 12}]
    answer = "The keeper counted ships all night and wrote each one down in the log."
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    results = [{"ok": True, "sent_at": 0.0, "messages": first, "text": answer, "output_tokens": 16},
               {"ok": True, "sent_at": 1.0, "messages": second, "text": "", "output_tokens": 1}]
    ceiling = run_ceiling(ARGS, results, tokenizer)
    turn1 = chat_prompt_token_ids(tokenizer, first)
    turn2 = chat_prompt_token_ids(tokenizer, second)
    # The second turn reuses at least the first prompt's full blocks.
    assert len(turn1) // 16 * 16 / (len(turn1) + len(turn2)) <= ceiling < len(turn2) / (len(turn1) + len(turn2))


def test_the_estimates_error_is_measured_minus_predicted_and_their_ratio() -> None:
    pairs = [(1.0, 1.5), (1.0, 2.0), (2.0, 1.0)] * 4
    error = prediction_error(pairs)
    assert error is not None and error["requests"] == 12
    assert error["error_s"]["p50"] == pytest.approx(0.5)
    assert error["measured_over_predicted"]["p10"] == pytest.approx(0.5)
    assert error["abs_log_error_p50"] == pytest.approx(0.6931, abs=1e-3)  # two thirds off by 2x
    assert prediction_error([]) is None
