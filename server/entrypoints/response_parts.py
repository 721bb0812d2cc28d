"""Pieces every endpoint's answer shares: the top log-probabilities of a position, in rank
order, and the `usage` object (OpenAI's shape, with vLLM's cached-token count)."""

from __future__ import annotations

from typing import Any

from kvscale.server.outputs import PositionLogprobs


def top_entries(position: PositionLogprobs, num_top: int) -> list[tuple[int, Any]]:
    ranked = sorted(position.items(), key=lambda item: item[1].rank)
    return [(token_id, lp) for token_id, lp in ranked if lp.rank <= num_top][:num_top]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
