"""What a request must satisfy before the engine takes it, checked once at the edge.

The edges are the HTTP API (kvscale.server.entrypoints.api_server) and the offline ``LLM``; they call these
and the client gets exactly one message per failure (the HTTP API's 400 and the offline
ValueError say the same). LLMEngine.add_request only asserts the same conditions: nothing
unchecked reaches it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvscale.server.config import MAX_PRIORITY

# Prompts one /v1/completions request may carry (--max-prompts-per-request): each becomes an
# engine request of its own, so a request of thousands would flood the queue by itself.
DEFAULT_MAX_PROMPTS_PER_REQUEST = 2048


class InvalidRequest(ValueError):
    """A request the engine must not see; ``param`` names the offending field (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def priority_refusal(priority: int, policy: str, flag: str = "--scheduling-policy priority") -> str | None:
    """Why a request's ``priority`` cannot be honoured under the scheduling ``policy``; None where
    it can. Under fcfs a non-zero one asks for what the server does not do, as vLLM refuses it;
    0 asks for nothing (docs/server.md, "Priority scheduling")."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        return f"priority must be an integer, got {priority!r}"
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        return f"priority must be between -2**31 and 2**31, got {priority}"
    if priority and policy != "priority":
        return f"priority cannot be honoured: this engine schedules first come, first served; start it with {flag}"
    return None


def check_prompt(token_ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    """A prompt has at least one token and every id is in the vocabulary."""
    if not token_ids:
        raise InvalidRequest("The prompt is empty.", param)
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"Token id {bad} is out of vocabulary (size {vocab_size}).", param)


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """Tokens to generate: what was asked, or what fits in the context when nothing was.

    The pool holds at least ``max_model_len`` tokens (the engine caps it so), so a request that
    fits the context always fits the pool.
    """
    if prompt_len >= max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_len} tokens, leaving no room for completion tokens. "
            "Please reduce the length of the prompt."
        )
    if requested is None:
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
            "for the completion). Please reduce the length of the prompt or max_tokens.",
            "max_tokens",
        )
    return requested
