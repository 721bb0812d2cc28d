"""The one place where a request's prompt becomes token ids.

The server and the router both call these, so a prompt maps to the same ids (and so the same
KV block hashes) on both sides. A change here changes routing; keep them in lockstep.
"""

from __future__ import annotations

from typing import Any


def completion_prompt_token_ids(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """Token ids of a /v1/completions prompt: a string is encoded with the tokenizer's special
    tokens (as vLLM does); a list of ids is taken as is."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    return [int(token_id) for token_id in prompt]


def render_chat_prompt(tokenizer: Any, messages: list[dict]) -> str:
    """The chat template applied to ``messages``, ending with the assistant turn's opening."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def chat_prompt_token_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of a /v1/chat/completions prompt.

    The template's text already holds every special token, so it is encoded without adding more
    (a second BOS would shift every block hash).
    """
    text = render_chat_prompt(tokenizer, messages)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
