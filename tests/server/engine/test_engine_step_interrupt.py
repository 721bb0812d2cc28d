"""A forward given up for a more urgent arrival, on a real engine (a tiny random Llama, CPU,
``--scheduling-policy priority``): the arrival is heard between the two decoder layers of a step
that prefills a low-priority prompt sharing the urgent one's first blocks. The step comes back
empty, the urgent prefill runs next in a step of its own without hitting the blocks the given-up
step never computed, every request ends with the greedy tokens it gets alone, and every block is
free at the end (docs/engine.md, "Priority scheduling")."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_checkpoints import (  # noqa: E402
    copy_tokenizer,
    decoder_layer_shapes,
    save_random_weights,
    write_tiny_scheduling_llama,
)

from kvscale.kernels import cpu_native
from kvscale.server.config import EngineConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.sampling_params import SamplingParams

LOW, URGENT = 5, 0
SHARED = [41, 42, 43, 44, 45, 46, 47, 48]  # two blocks of 4
PROMPTS = {"low-a": [11, 12, 13, 14, 15, 16], "low-b": [21, 22, 23, 24, 25, 26],
           "low-c": SHARED + [51, 52, 53], "urgent": SHARED + [61, 62]}


@pytest.fixture(scope="module")
def tiny_llama(bundled_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_scheduling_llama(tmp_path_factory.mktemp("tiny-llama-interrupt"), bundled_model_path)


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


def add_taken(engine: LLMEngine, name: str, priority: int) -> None:
    """What the core's loop does with a request the input thread queued: takes it (the step after
    carries it), then adds it."""
    assert engine.step_interrupt is not None
    engine.step_interrupt.taken()
    engine.add_request(name, PROMPTS[name], params(), priority=priority)


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
    add_taken(engine, "urgent", URGENT)
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
    engine.step_interrupt.taken()
    assert not engine.step_given_up and engine.step_interrupt.num_interrupted == 1


def test_only_priority_scheduling_on_one_cpu_rank_gives_steps_up(tiny_llama: Path) -> None:
    assert engine_of(tiny_llama, "fcfs").step_interrupt is None


@pytest.fixture(scope="module")
def one_call_llama(bundled_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama whose projections' widths (multiples of 64) the C projections take."""
    path = tmp_path_factory.mktemp("tiny-llama-one-call")
    copy_tokenizer(bundled_model_path, path)
    hidden, inter, heads, kv_heads, head_dim = 128, 256, 4, 2, 32
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (512, hidden), "lm_head.weight": (512, hidden),
                                          "model.norm.weight": (hidden,)}
    for i in range(2):
        shapes.update(decoder_layer_shapes(f"model.layers.{i}.", hidden, heads, kv_heads, head_dim, inter))
    save_random_weights(path, shapes, 0.08, 0.1)
    return path


@pytest.mark.skipif(not (cpu_native.amx_linear_available() or cpu_native.dot_linear_available()),
                    reason="a step's layers run in C calls only on AMX or AVX-512 BF16 projections")
def test_a_step_whose_layers_run_in_c_calls_is_given_up_between_runs(one_call_llama: Path) -> None:
    """In bfloat16 a decode step's layers run in C calls (server/worker/cpu_step_layers.py), no
    module pre-hook: the check runs between runs of layers instead. Against the same requests
    where the step in flight runs to its end, every request's tokens are the same."""

    def run(give_up: bool) -> tuple[dict[str, list[int]], LLMEngine]:
        engine = LLMEngine(EngineConfig(model=str(one_call_llama), dtype="bfloat16", device="cpu", block_size=4,
                                        num_gpu_blocks_override=64, max_num_seqs=4, scheduling_policy="priority"))
        assert engine.step_interrupt is not None
        tokens: dict[str, list[int]] = {}

        def step() -> list[Any]:
            outputs = engine.step()
            tokens.update({o.request_id: list(o.outputs[0].token_ids) for o in outputs if o.finished})
            return outputs

        for name in ("low-a", "low-b"):
            engine.add_request(name, PROMPTS[name], params(), priority=LOW)
        step()
        step()  # both decoding, on the one-call path
        assert engine.model._cpu_step_layers is not None
        assert engine.model.one_call_check == engine.step_interrupt.check
        if give_up:
            interrupt = engine.step_interrupt

            def arrival_then_check() -> None:  # the input thread hears it during the first run
                interrupt.on_arrival(URGENT)
                interrupt.check()

            engine.model.one_call_check = arrival_then_check
            assert step() == [] and engine.step_given_up
            engine.model.one_call_check = interrupt.check
        add_taken(engine, "urgent", URGENT)
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            step()
        assert engine.pool.num_active_blocks == 0
        return tokens, engine

    given_up, engine = run(give_up=True)
    assert engine.step_interrupt is not None and engine.step_interrupt.num_interrupted == 1
    finished, _ = run(give_up=False)
    assert given_up == finished and set(finished) == {"low-a", "low-b", "urgent"}
