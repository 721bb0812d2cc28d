"""``--scheduling-policy priority`` on a real engine (a tiny random Llama, CPU): with KV blocks
scarce, the least urgent running request is preempted rather than the newest, a more urgent one
that arrived later is admitted before it comes back, and every request ends with the greedy
tokens it gets alone (docs/engine.md, "Priority scheduling")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_checkpoints import write_tiny_scheduling_llama  # noqa: E402

from kvscale.server.config import EngineConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.sampling_params import SamplingParams

VOCAB = 500
MAX_TOKENS = 16
PROMPTS = {"lazy": [11, 12, 13, 14, 15, 16, 17, 18], "busy": [21, 22, 23, 24, 25, 26, 27, 28],
           "urgent": [31, 32, 33, 34, 35, 36, 37, 38]}
PRIORITIES = {"lazy": 5, "busy": 3, "urgent": 0}


@pytest.fixture(scope="module")
def tiny_llama(bundled_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_scheduling_llama(tmp_path_factory.mktemp("tiny-llama-priority"), bundled_model_path, VOCAB)


def engine_of(path: Path, policy: str, num_blocks: int = 10, async_scheduling: bool = False,
              max_num_seqs: int = 2) -> LLMEngine:
    # Blocks of 4: two running requests of 8 + 16 tokens need 6 blocks each, and 10 are there;
    # two slots, so the third waits for one.
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=4,
                                  num_gpu_blocks_override=num_blocks, max_num_seqs=max_num_seqs,
                                  enable_prefix_caching=False, scheduling_policy=policy,
                                  async_scheduling=async_scheduling))


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def priority_of(engine: LLMEngine, name: str) -> int:
    # The engine itself takes any priority (the edges refuse a non-zero one under fcfs): fcfs
    # must ignore it.
    return PRIORITIES[name]


def scenario(engine: LLMEngine) -> tuple[dict[str, list[int]], list[str], list[str]]:
    """lazy and busy start; urgent arrives once both run (under priority busy, the more urgent,
    prefills a step ahead of lazy: urgent_prefill.py). Returns each one's tokens, the order
    requests were (re)admitted in and the order they were preempted in."""
    tokens: dict[str, list[int]] = {}
    admitted: list[str] = []
    preempted: list[str] = []
    running: set[str] = set()
    for name in ("lazy", "busy"):
        engine.add_request(name, PROMPTS[name], params(), priority=priority_of(engine, name))
    for step in range(500):
        if step == 2:
            engine.add_request("urgent", PROMPTS["urgent"], params(), priority=priority_of(engine, "urgent"))
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
        now = {seq.request.request_id for seq in engine.scheduler.running}
        admitted += sorted(now - running)
        preempted += [seq.request.request_id for seq in engine.scheduler.waiting
                      if seq.preempted and seq.request.request_id not in preempted]
        running = now
    assert not engine.has_unfinished_requests()
    return tokens, admitted, preempted


@pytest.fixture(scope="module")
def alone(tiny_llama: Path) -> dict[str, list[int]]:
    """Each request's greedy tokens, run alone."""
    tokens: dict[str, list[int]] = {}
    solo = engine_of(tiny_llama, "priority", num_blocks=64)
    for name, prompt in PROMPTS.items():
        solo.add_request(name, prompt, params())
        while solo.has_unfinished_requests():
            for output in solo.step():
                if output.finished:
                    tokens[name] = list(output.outputs[0].token_ids)
    return tokens


def test_the_least_urgent_is_preempted_and_the_urgent_one_goes_first(tiny_llama: Path,
                                                                    alone: dict[str, list[int]]) -> None:
    tokens, admitted, preempted = scenario(engine_of(tiny_llama, "priority"))
    assert tokens == alone
    # fcfs would preempt busy, the newest; priority preempts lazy (5), the least urgent, as
    # soon as urgent (0) arrives and finds no slot; busy (3) then gives its blocks to urgent's
    # growth, and both come back after it, the more urgent first.
    assert preempted[0] == "lazy" and "urgent" not in preempted
    assert admitted == ["busy", "lazy", "urgent", "busy", "lazy"]

    tokens, admitted, preempted = scenario(engine_of(tiny_llama, "fcfs"))
    assert tokens == alone
    assert preempted[0] == "busy"

    # Async scheduling (the next step queued before this one's tokens are read) keeps it all.
    tokens, admitted, preempted = scenario(engine_of(tiny_llama, "priority", async_scheduling=True))
    assert tokens == alone
    assert preempted[0] == "lazy" and "urgent" not in preempted


def urgent_prefill_step(engine: LLMEngine) -> tuple[list[str], dict[str, list[int]]]:
    """lazy and busy decode in slots to spare; urgent arrives. Returns the requests whose
    sequences the step that prefilled urgent's prompt computed, and each one's tokens."""
    for name in ("lazy", "busy"):
        engine.add_request(name, PROMPTS[name], params(), priority=priority_of(engine, name))
    engine.step()
    engine.step()
    engine.add_request("urgent", PROMPTS["urgent"], params(), priority=priority_of(engine, "urgent"))
    tokens: dict[str, list[int]] = {}
    in_step: list[str] = []
    while engine.has_unfinished_requests():
        seqs = list(engine.scheduler.running) + list(engine.scheduler.waiting)
        computed = {seq.seq_id: seq.num_computed_tokens for seq in seqs}
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
        urgent = next((seq for seq in seqs if seq.request.request_id == "urgent"), None)
        if (urgent is not None and computed[urgent.seq_id] < urgent.num_prompt_tokens
                <= urgent.num_computed_tokens):
            in_step = sorted(seq.request.request_id for seq in seqs
                             if seq.num_computed_tokens != computed[seq.seq_id])
    return in_step, tokens


def test_an_urgent_arrival_prefills_in_a_step_without_less_urgent_rows(tiny_llama: Path,
                                                                      alone: dict[str, list[int]]) -> None:
    # Its first token comes from a step as long as its prefill alone (docs/engine.md, "Priority
    # scheduling"; server/core/urgent_prefill.py); the others skip that step and lose nothing.
    for async_scheduling in (False, True):
        engine = engine_of(tiny_llama, "priority", num_blocks=64, async_scheduling=async_scheduling,
                           max_num_seqs=4)
        in_step, tokens = urgent_prefill_step(engine)
        assert in_step == ["urgent"]
        assert tokens == alone
    engine = engine_of(tiny_llama, "fcfs", num_blocks=64, max_num_seqs=4)
    in_step, tokens = urgent_prefill_step(engine)
    assert in_step == ["busy", "lazy", "urgent"]
    assert tokens == alone
