"""A request's sequences as the engine makes them: the first one when the request arrives, the
other n-1 samples once its prompt is prefilled (they share the prompt's blocks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvscale.server.core.kv_cache_manager import blocks_for
from kvscale.server.core.sequence import Request, Sequence
from kvscale.server.engine.detokenizer import init_detokenizer
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.sampler import make_generator

if TYPE_CHECKING:
    from kvscale.server.engine.llm_engine import LLMEngine
    from kvscale.server.outputs import RequestMetrics


def new_request(
    engine: LLMEngine, request_id: str, prompt: str | list[int], params: SamplingParams,
    metrics: RequestMetrics, *, cache_salt: str | None, group: str, tenant: str,
    lora_name: str | None, priority: int,
) -> Request:
    """The request and its first sequence, the prompt tokenized. The edges (the HTTP API, the
    offline LLM) validate requests with kvscale.server.entrypoints.admission, one message per
    failure; here the same conditions are only asserted."""
    if isinstance(prompt, str):
        prompt_text: str | None = prompt
        token_ids = engine.tokenizer.encode(prompt)
    else:
        prompt_text = None
        token_ids = [int(t) for t in prompt]
    num_prompt = len(token_ids)
    assert num_prompt and all(0 <= t < engine.vocab_size for t in token_ids), "unchecked prompt"
    max_len = engine.max_model_len
    max_tokens = max_len - num_prompt if params.max_tokens is None else params.max_tokens
    assert max_tokens >= 1 and num_prompt + max_tokens <= max_len, "unchecked max_tokens"
    # max_model_len is capped by the pool, so a request within it always fits the pool.
    assert blocks_for(num_prompt + max_tokens, engine.block_size) <= engine.num_blocks
    request = Request(request_id, prompt_text, token_ids, params, cache_salt, metrics, max_tokens,
                      group=group, tenant=tenant, lora_name=engine.runner.registered_lora(lora_name),
                      priority=priority)
    if params.prompt_logprobs is not None:
        request.prompt_logprobs = [None] * num_prompt
    seq = Sequence(request, 0, list(token_ids), num_prompt, fork_into=params.n)
    seq.generator = make_generator(params.seed, 0)
    init_detokenizer(seq)
    request.seqs.append(seq)
    return request


def fork_samples(engine: LLMEngine, parent: Sequence) -> list[Sequence]:
    """The other n-1 samples of a just-prefilled prompt, sharing its blocks, running from now."""
    request = parent.request
    children = []
    for index in range(1, parent.fork_into):
        child = Sequence(request, index, list(parent.token_ids), parent.num_prompt_tokens)
        engine.kv.fork(parent, child)
        child.generator = make_generator(request.params.seed, index)
        init_detokenizer(child)
        engine.structured.fork(parent, child)
        request.seqs.append(child)
        engine.scheduler.add_running(child)
        children.append(child)
    parent.fork_into = 1
    return children

