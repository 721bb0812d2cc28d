"""The offline API, shaped like vLLM's: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from kvscale.server.config import EngineConfig
from kvscale.server.engine.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    BeamSearchState,
    beam_step,
    stop_on,
    top_candidates,
)
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.engine.output_builder import OutputKind
from kvscale.server.entrypoints.admission import check_prompt, priority_refusal, resolve_max_tokens
from kvscale.server.outputs import RequestOutput
from kvscale.server.sampling_params import SamplingParams
from kvscale.tokenization import completion_prompt_token_ids

PromptType = str | dict[str, Any] | list[int]
ChatMessages = list[dict[str, Any]]


def pin_cpu_threads() -> list[int]:
    """Pin torch's OpenMP threads one per CPU, as vLLM's CPU worker does (kernels/cpu_threads.c
    says why); returns the CPUs used, [] when nothing was pinned.

    Only with two threads or more (one thread has no barrier to wait at), only on CPUs this
    process may use, and not when ``KVSCALE_CPU_OMP_THREADS_BIND=nobind``. The calling thread is
    the pool's first, so it stays on the first CPU afterwards, and processes it starts inherit that.
    """
    import os

    import torch

    from kvscale.kernels import cpu_native

    threads = torch.get_num_threads()
    if os.environ.get("KVSCALE_CPU_OMP_THREADS_BIND", "auto") == "nobind" or threads < 2:
        return []
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    if len(cpus) < 2:
        return []
    return cpus if cpu_native.bind_threads(cpus) else []


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        num_gpu_blocks_override: int | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        **engine_kwargs: Any,
    ) -> None:
        config = EngineConfig(
            model=model,
            dtype=dtype,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            num_gpu_blocks_override=num_gpu_blocks_override,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            **engine_kwargs,
        )
        self.llm_engine = LLMEngine(config)
        # generate() returns finished requests only: a running one costs its step nothing.
        self.llm_engine.output_kind = OutputKind.FINAL_ONLY
        if self.llm_engine.device.type == "cpu":
            pin_cpu_threads()
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of ``prompts``. ``priority``:
        one per prompt, lower first (vLLM's; non-zero needs ``scheduling_policy="priority"``)."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts"
                )
        engine = self.llm_engine
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        for value in priorities:
            why = priority_refusal(value, engine.config.scheduling_policy, 'LLM(scheduling_policy="priority")')
            if why is not None:
                raise ValueError(why)
        request_ids: list[str] = []
        try:
            for prompt, params, rank in zip(prompts, params_list, priorities, strict=True):
                request_id = f"llm-{next(self._ids)}"
                engine_prompt = self._engine_prompt(prompt)
                # The offline edge: the same checks and messages as the HTTP API's.
                ids = completion_prompt_token_ids(engine.tokenizer, engine_prompt)
                check_prompt(ids, engine.vocab_size)
                resolve_max_tokens(params.max_tokens, len(ids), engine.max_model_len)
                engine.add_request(request_id, engine_prompt, params, priority=rank)
                request_ids.append(request_id)
            return self._run(request_ids, use_tqdm)
        except BaseException:
            for request_id in request_ids:
                engine.abort_request(request_id)
            raise

    def beam_search(self, prompts: Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: each prompt's ``params.beam_width`` best beams, best first.
        Each step every live beam is one greedy 1-token request asking for its top
        ``2 * beam_width`` logprobs; server/engine/beam_search.py keeps the books."""
        engine = self.llm_engine
        prompt_ids, states = [], []
        for prompt in prompts:
            ids = completion_prompt_token_ids(engine.tokenizer, self._engine_prompt(prompt))
            check_prompt(ids, engine.vocab_size)
            max_tokens = resolve_max_tokens(params.max_tokens, len(ids), engine.max_model_len)
            prompt_ids.append(ids)
            states.append(BeamSearchState(params.beam_width, max_tokens, params.length_penalty,
                                          params.early_stopping))
        stop = stop_on(set() if params.ignore_eos else engine.eos_token_ids)
        step = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(states), desc="kvscale: beam search")
        while not all(state.done for state in states):
            live = [(state, ids) for state, ids in zip(states, prompt_ids, strict=True) if not state.done]
            request_ids: list[list[str]] = []
            try:
                for state, ids in live:
                    request_ids.append([])
                    for beam in state.live:
                        request_id = f"llm-{next(self._ids)}"
                        engine.add_request(request_id, ids + list(beam.tokens), step)
                        request_ids[-1].append(request_id)
                outputs = self._run([r for group in request_ids for r in group], False)
            except BaseException:
                for request_id in (r for group in request_ids for r in group):
                    engine.abort_request(request_id)
                raise
            done = iter(outputs)
            for (state, _), group in zip(live, request_ids, strict=True):
                candidates = []
                for _ in group:
                    position = (next(done).outputs[0].logprobs or [{}])[0]
                    candidates.append(top_candidates({t: lp.logprob for t, lp in position.items()},
                                                     state.num_logprobs))
                beam_step(state, candidates, stop)
                if bar is not None and state.done:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [self._beam_output(state, ids, params) for state, ids in zip(states, prompt_ids, strict=True)]

    def _beam_output(self, state: BeamSearchState, prompt_ids: list[int],
                     params: BeamSearchParams) -> BeamSearchOutput:
        sequences = []
        for beam in state.best():
            tokens = list(beam.tokens)
            if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
                tokens = tokens[:-1]
            sequences.append(BeamSearchSequence(
                tokens=prompt_ids + tokens, logprobs=list(beam.logprobs), cum_logprob=beam.cum_logprob,
                text=self.llm_engine.tokenizer.decode(prompt_ids + tokens), finish_reason=beam.finish_reason,
                stop_reason=beam.stop_reason, score=state.score(beam)))
        return BeamSearchOutput(sequences)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.llm_engine.tokenizer
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            # The template already holds any special tokens; don't add a second BOS.
            prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _engine_prompt(self, prompt: PromptType) -> str | list[int]:
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return str(prompt["prompt"])
        raise ValueError(
            "a prompt is a string, a list of token ids, or a dict with 'prompt' or 'prompt_token_ids'"
        )

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="kvscale: generating")
        while pending:
            for output in engine.step():
                if output.finished and output.request_id in pending:
                    finished[output.request_id] = output
                    pending.discard(output.request_id)
                    if bar is not None:
                        bar.update(1)
            if pending and not engine.has_unfinished_requests():
                raise RuntimeError(f"engine stopped with requests unfinished: {sorted(pending)}")
        if bar is not None:
            bar.close()
        return [finished[request_id] for request_id in request_ids]
