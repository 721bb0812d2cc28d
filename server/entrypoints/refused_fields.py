"""Request fields OpenAI's API or vLLM's extras define that this server cannot carry out: a 400
naming the field and why, never a silent 200 (docs/server.md, "Every request field").

A field at its neutral value (vLLM's default, or what the server does anyway) asks for nothing
and passes: `best_of` equal to `n`. Beam search's fields (`use_beam_search`,
`length_penalty`) and what beam search cannot be combined with are serving_beam.py's checks.
"""

from __future__ import annotations

from typing import Any

from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints.serving import bad_request
from kvscale.server.entrypoints.serving_beam import check_beam_search

REFUSED_FIELDS: dict[str, str] = {
    "best_of": "server-side best-of sampling is not implemented; use n and pick on the client",
    "suffix": "insertion (text after the completion) is not supported by the served model",
    "modalities": "only text output is supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not available",
    "reasoning_effort": "the served model has no reasoning mode",
    "functions": "the deprecated functions field is not supported; use tools",
    "function_call": "the deprecated function_call field is not supported; use tool_choice",
    "guided_json": "vLLM's removed guided_* fields are not supported; use structured_outputs.json",
    "guided_regex": "vLLM's removed guided_* fields are not supported; use structured_outputs.regex",
    "guided_choice": "vLLM's removed guided_* fields are not supported; use structured_outputs.choice",
    "guided_grammar": "vLLM's removed guided_* fields are not supported; use structured_outputs.grammar",
    # vLLM's sampling extras this engine does not implement.
    "prompt_logprobs": "prompt log-probabilities are returned only by completions' echo with logprobs",
    "allowed_token_ids": "not implemented; use logit_bias",
    "bad_words": "not implemented; use logit_bias on the words' tokens",
    "truncate_prompt_tokens": "prompts are never truncated: a prompt over the context is refused",
    "logits_processors": "custom logits processors are not loaded by this server",
    "vllm_xargs": "this server takes no extension arguments",
    "kv_transfer_params": "disaggregated prefill (KV transfer) is not available",
    "return_tokens_as_token_ids": "not implemented",
    "spaces_between_special_tokens": "special tokens are always decoded with the tokenizer's spacing",
    # Chat only.
    "echo": "chat's echo (the last message before the answer) is not implemented",
    "continue_final_message": "continuing the final message is not implemented",
    "add_generation_prompt": "the generation prompt is always added",
    "chat_template": "the model's own chat template is always used",
    "chat_template_kwargs": "the chat template takes no arguments here",
    "documents": "the chat template takes no documents here",
    "mm_processor_kwargs": "the served model takes text only",
}

# What a field asks for nothing at (absent from here: only null does).
NEUTRAL_VALUES: dict[str, Any] = {
    "modalities": ["text"],
    "return_tokens_as_token_ids": False, "spaces_between_special_tokens": True,
    "continue_final_message": False, "add_generation_prompt": True,
}


# Chat's own: completions' echo (the prompt before the completion) is honoured.
CHAT_ONLY = frozenset({"echo", "continue_final_message", "add_generation_prompt", "chat_template",
                       "chat_template_kwargs", "documents", "mm_processor_kwargs"})


def check_refused_fields(body: p.SamplingFields) -> None:
    """Raise a 400 for the first field of ``body`` this server cannot honour."""
    chat = isinstance(body, p.ChatCompletionRequest)
    check_beam_search(body)
    for name, why in REFUSED_FIELDS.items():
        if name in CHAT_ONLY and not chat:
            continue
        value = getattr(body, name, None)
        if value is None or value == NEUTRAL_VALUES.get(name, None) or (
                name == "best_of" and value == body.n):
            continue
        raise bad_request(f"{name} cannot be honoured by this server: {why}.", name)
    if body.store:
        raise bad_request("store: true cannot be honoured: this server stores no completions.", "store")
