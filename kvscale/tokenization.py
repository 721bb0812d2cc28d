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


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def message_text(content: Any) -> str:
    """A message's content as the template sees it: a string as is, text parts joined, null as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError("message content must be a string, a list of text parts, or null")


def normalize_chat_messages(messages: Any) -> list[dict[str, str]]:
    """The conversation handed to the chat template: each message's role and text, nothing else.

    Takes the request's ``messages`` as JSON (the router passes the raw body, the server its
    validated messages dumped back to dicts), so both render the same text. Fields a template
    could render differently (names, tool calls, tool call ids) are dropped on both sides.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    conversation = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise ValueError(f"each message needs a role, one of {', '.join(CHAT_ROLES)}")
        conversation.append({"role": message["role"], "content": message_text(message.get("content"))})
    return conversation


def render_chat_prompt(tokenizer: Any, messages: list[dict]) -> str:
    """The chat template applied to ``messages`` (normalised first), ending with the assistant
    turn's opening."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
    conversation = normalize_chat_messages(messages)
    return tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)


def chat_prompt_token_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of a /v1/chat/completions prompt, from the request's ``messages`` as JSON."""
    return chat_text_token_ids(tokenizer, render_chat_prompt(tokenizer, messages))


def chat_text_token_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered chat-template text (or a piece of it, cut after a special token).

    The text already holds every special token, so it is encoded without adding more (a second
    BOS would shift every block hash).
    """
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
