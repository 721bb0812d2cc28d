"""A forward given up for a more urgent arrival, on a real engine (a tiny random Llama, CPU,
``--scheduling-policy priority``): the arrival is heard between the two decoder layers of a step
that prefills a low-priority prompt sharing the urgent one's first blocks. The step comes back
empty, the urgent prefill runs next in a step of its own without hitting the blocks the given-up
step never computed, every request ends with the greedy tokens it gets alone, and every block is
free at the end (docs/engine.md, "Priority scheduling")."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_checkpoints import copy_tokenizer, write_tiny_llama  # noqa: E402

from kvscale.server.config import EngineConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.sampling_params import SamplingParams

LOW, URGENT = 5, 0
SHARED = [41, 42, 43, 44, 45, 46, 47, 48]  # two blocks of 4
PROMPTS = {"low-a": [11, 12, 13, 14, 15, 16], "low-b": [21, 22, 23, 24, 25, 26],
           "low-c": SHARED + [51, 52, 53], "urgent": SHARED + [61, 62]}


@pytest.fixture(scope="module")
def tiny_llama(bundled_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-interrupt")
    copy_tokenizer(bundled_model_path, path)
    write_tiny_llama(path, vocab=500, tie_word_embeddings=False, rms_norm_eps=1e-6,
                     max_position_embeddings=256, norm_jitter=0.1)
    return path


def engine_of(path: Path, policy: str = "priority") -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=4,
                                  num_gpu_blocks_override=64, max_num_seqs=4, scheduling_policy=policy))


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def alone(path: Path, name: str) -> list[int]:
    engine = engine_of(path, "fcfs")
    engine.add_request(name, PROMPTS[name], params())
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                return list(output.outputs[0].token_ids)
    raise AssertionError("never finished")


class ArrivalAtLayer0:
    """What the core's input thread does when a request arrives during a forward: a pre-hook
    on the first layer calls on_arrival once, in the step it is primed for."""

    def __init__(self, engine: LLMEngine, priority: int) -> None:
        self.engine, self.priority, self.primed, self.heard = engine, priority, False, 0
        engine.model.layers[0].register_forward_pre_hook(self)

    def __call__(self, *_: Any) -> None:
        if self.primed:
            self.primed = False
            self.heard += 1
            assert self.engine.step_interrupt is not None
            self.engine.step_interrupt.on_arrival(self.priority)


def test_an_urgent_arrival_gives_up_the_step_in_flight(tiny_llama: Path) -> None:
    engine = engine_of(tiny_llama)
    assert engine.step_interrupt is not None
    arrival = ArrivalAtLayer0(engine, URGENT)
    tokens: dict[str, list[int]] = {}

    def step() -> list[Any]:
        outputs = engine.step()
        for output in outputs:
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
        return outputs

    for name in ("low-a", "low-b"):
        engine.add_request(name, PROMPTS[name], params(), priority=LOW)
    step()
    step()  # both decoding
    engine.add_request("low-c", PROMPTS["low-c"], params(), priority=LOW)
    arrival.primed = True
    assert step() == [] and engine.step_given_up and arrival.heard == 1
    assert engine.step_interrupt.num_interrupted == 1
    # Taken back: low-c waits without blocks, and nobody finds its prompt's blocks.
    assert [seq.request.request_id for seq in engine.scheduler.waiting] == ["low-c"]
    assert engine.scheduler.waiting[0].block_table == []
    engine.add_request("urgent", PROMPTS["urgent"], params(), priority=URGENT)
    outputs = step()
    assert [output.request_id for output in outputs] == ["urgent"]  # its first token, alone
    assert engine.requests["urgent"].num_cached_tokens == 0
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        step()
    assert not engine.has_unfinished_requests()
    assert tokens == {name: alone(tiny_llama, name) for name in PROMPTS}
    assert engine.pool.num_active_blocks == 0
    # Only the primed arrival gave a step up: arrivals of equal or lower urgency never do.
    arrival.priority, arrival.primed = LOW, True
    engine.add_request("low-d", PROMPTS["low-a"], params(), priority=LOW)
    engine.add_request("low-e", PROMPTS["low-b"], params(), priority=LOW)
    step()
    assert not engine.step_given_up and engine.step_interrupt.num_interrupted == 1


def test_only_priority_scheduling_on_one_cpu_rank_gives_steps_up(tiny_llama: Path) -> None:
    assert engine_of(tiny_llama, "fcfs").step_interrupt is None
