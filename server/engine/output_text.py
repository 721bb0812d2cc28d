"""The text of the engine core's outputs, made on the front end.

The core process sends token ids only (``LLMEngine.detokenize`` off): turning them into text and
finding stop strings is work for the front end, beside tokenization and streaming, so the core's
steps spend nothing on it. Each sample keeps the detokenizer's window (kvscale.server.engine.detokenizer,
the same functions the engine uses in-process) and what earlier deltas carried. A stop string ends
its sample here: the delta is cut after the token that completed it (with its logprobs), and once
every sample of a request has ended the request is finished and the core is told to abort it,
which frees its KV blocks. Text that could still become a stop string is held back, as the engine
does in-process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvscale.server.engine.detokenizer import (
    detokenize_incrementally,
    find_stop_string,
    init_detokenizer,
    visible_text_len,
)
from kvscale.server.outputs import RequestOutput
from kvscale.server.sampling_params import SamplingParams


@dataclass(eq=False)
class SampleText:
    """One sample's tokens and text, as the front end has received them."""

    params: SamplingParams
    token_ids: list[int]  # the prompt's, then the sample's
    num_prompt_tokens: int
    text: str = ""
    detok_base: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    sent_text: int = 0  # characters of text earlier deltas carried
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class RequestText:
    params: SamplingParams
    samples: dict[int, SampleText] = field(default_factory=dict)
    prompt_token_ids: list[int] | None = None  # from the request's first delta, the only one with them

    def all_ended(self) -> bool:
        return len(self.samples) == self.params.n and all(s.is_finished for s in self.samples.values())


class OutputText:
    """Every open request's samples; ``apply`` fills in each delta as it arrives from the core."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, RequestText] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request_id: str, params: SamplingParams) -> None:
        self._requests[request_id] = RequestText(params)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def clear(self) -> None:
        self._requests.clear()

    def apply(self, output: RequestOutput) -> bool:
        """Give ``output``'s completions their text, in place, ending samples at stop strings.
        True when this delta ended the request here, so that the core must abort it."""
        request = self._requests.get(output.request_id)
        if request is None:  # ended here already: the core's last steps are nobody's
            return False
        if request.prompt_token_ids is None:
            request.prompt_token_ids = output.prompt_token_ids
        prompt = request.prompt_token_ids
        for completion in output.outputs:
            sample = request.samples.get(completion.index)
            if sample is None:
                sample = request.samples[completion.index] = SampleText(request.params, list(prompt), len(prompt))
                init_detokenizer(sample)
            if sample.is_finished:
                # Ended by a stop string in an earlier delta; the core ran on until told.
                completion.token_ids, completion.text = [], ""
                completion.logprobs = [] if completion.logprobs is not None else None
                completion.finish_reason, completion.stop_reason = sample.finish_reason, sample.stop_reason
                continue
            for taken, token in enumerate(completion.token_ids, start=1):
                sample.token_ids.append(token)
                piece = detokenize_incrementally(self.tokenizer, sample)
                if sample.num_output_tokens >= request.params.min_tokens and find_stop_string(sample, len(piece)):
                    del completion.token_ids[taken:]
                    if completion.logprobs is not None:
                        del completion.logprobs[taken:]
                    completion.finish_reason, completion.stop_reason = sample.finish_reason, sample.stop_reason
                    break
            else:
                sample.finish_reason = completion.finish_reason
                sample.stop_reason = completion.stop_reason
            text_end = max(visible_text_len(sample), sample.sent_text)
            completion.text = sample.text[sample.sent_text:text_end]
            sample.sent_text = text_end
        if output.finished:
            del self._requests[output.request_id]
            return False
        if request.all_ended():
            output.finished = True
            del self._requests[output.request_id]
            return True
        return False
