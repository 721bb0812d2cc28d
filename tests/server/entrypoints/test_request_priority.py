"""The ``priority`` request field (vLLM's): taken under --scheduling-policy priority, a 400 naming
the flag under fcfs unless 0, bounded, an integer; the offline ``LLM.generate(priority=...)`` alike."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_checkpoints import write_tiny_scheduling_llama  # noqa: E402

from kvscale import LLM, SamplingParams
from kvscale.model_files import load_tokenizer, resolve_model_path
from kvscale.request_limits import FieldLimits
from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints.protocol_responses import ResponsesRequest
from kvscale.server.entrypoints.responses_input import chat_request
from kvscale.server.entrypoints.serving import APIError, OpenAIServer
from kvscale.server.entrypoints.serving_chat import prepare_chat
from kvscale.server.entrypoints.serving_completions import prepare_completion

MESSAGES = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> p.CompletionRequest:
    return p.CompletionRequest.model_validate({"prompt": "hi", **fields})


def chat(**fields: Any) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model_path(None))


def server_of(tokenizer: Any, policy: str) -> OpenAIServer:
    return OpenAIServer(None, tokenizer=tokenizer, served_model_names=["m"],  # type: ignore[arg-type]
                        max_model_len=64, scheduling_policy=policy)


def test_fcfs_refuses_a_nonzero_priority_naming_the_flag(tokenizer: Any) -> None:
    server = server_of(tokenizer, "fcfs")
    cases: list[tuple[Any, Any]] = [(prepare_completion, completion(priority=-3)),
                                    (prepare_chat, chat(priority=2))]
    for prepare, body in cases:
        with pytest.raises(APIError) as error:
            prepare(server, body)
        assert error.value.status == 400 and error.value.param == "priority"
        assert "--scheduling-policy priority" in error.value.message
    # /v1/responses runs as chat: its priority is checked there.
    responses = ResponsesRequest.model_validate({"input": "hi", "priority": 4})
    with pytest.raises(APIError) as error:
        prepare_chat(server, chat_request(responses, [], FieldLimits())[0])
    assert error.value.param == "priority"
    # 0 and absent ask for nothing.
    assert prepare_completion(server, completion(priority=0)).priority == 0
    assert prepare_chat(server, chat()).priority == 0


def test_priority_policy_carries_the_field_within_its_bounds(tokenizer: Any) -> None:
    server = server_of(tokenizer, "priority")
    assert prepare_completion(server, completion(priority=-7)).priority == -7
    assert prepare_chat(server, chat(priority=2**31)).priority == 2**31
    responses = ResponsesRequest.model_validate({"input": "hi", "priority": 4})
    assert prepare_chat(server, chat_request(responses, [], FieldLimits())[0]).priority == 4
    with pytest.raises(APIError) as error:
        prepare_completion(server, completion(priority=2**31 + 1))
    assert error.value.param == "priority" and "2**31" in error.value.message
    for value in ("1", 1.5, True):
        with pytest.raises(ValidationError):
            p.CompletionRequest.model_validate({"prompt": "hi", "priority": value})


@pytest.fixture(scope="module")
def tiny_llama(bundled_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_scheduling_llama(tmp_path_factory.mktemp("tiny-llama-llm-priority"), bundled_model_path)


def test_offline_generate_takes_one_priority_per_prompt(tiny_llama: Path) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    fcfs = LLM(model=str(tiny_llama), dtype="float32", device="cpu", num_gpu_blocks_override=32)
    with pytest.raises(ValueError, match='scheduling_policy="priority"'):
        fcfs.generate([[5, 6, 7]], greedy, priority=[1])
    alone = fcfs.generate([[5, 6, 7], [8, 9]], greedy, priority=[0, 0])
    llm = LLM(model=str(tiny_llama), dtype="float32", device="cpu", num_gpu_blocks_override=32,
              scheduling_policy="priority")
    with pytest.raises(ValueError, match="2 prompts"):
        llm.generate([[5, 6, 7], [8, 9]], greedy, priority=[1])
    outputs = llm.generate([[5, 6, 7], [8, 9]], greedy, priority=[3, -1])
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in alone]
