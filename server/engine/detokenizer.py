"""Incremental detokenization and stop conditions for one sequence.

Decoding a token alone loses context (leading spaces, multi-byte characters split across
tokens), so each step decodes a short window: the tokens since ``prefix_offset`` and, to
subtract, the ones up to ``read_offset``. A window ending in U+FFFD is an incomplete character
and waits for the next token.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvscale.server.sampling_params import SamplingParams


class DetokenizedSample(Protocol):
    """What these functions read and write of a sample: the engine's Sequence, or the front
    end's SampleText when the engine runs in its own process (kvscale.server.engine.output_text)."""

    token_ids: list[int]
    num_prompt_tokens: int
    text: str
    detok_base: int
    prefix_offset: int
    read_offset: int
    finish_reason: str | None
    stop_reason: str | int | None

    @property
    def params(self) -> SamplingParams: ...

    @property
    def is_finished(self) -> bool: ...


def init_detokenizer(seq: DetokenizedSample) -> None:
    """Start the window a few prompt tokens back, so the first output token gets its context."""
    seq.detok_base = max(seq.num_prompt_tokens - 4, 0)
    seq.prefix_offset = 0
    seq.read_offset = seq.num_prompt_tokens - seq.detok_base


def detokenize_incrementally(tokenizer: Any, seq: DetokenizedSample) -> str:
    """Append the text of ``seq``'s newest tokens to ``seq.text``; returns the new piece."""
    skip = seq.params.skip_special_tokens
    ids = seq.token_ids[seq.detok_base :]
    prefix_text = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
    new_text = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
    if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
        piece = new_text[len(prefix_text) :]
        seq.text += piece
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)
        return piece
    return ""


def find_stop_string(seq: DetokenizedSample, piece_len: int) -> bool:
    """End ``seq`` at the first stop string that the latest piece completed; trims the text."""
    if not seq.params.stop or not piece_len:
        return False
    # Only the text the latest piece can have completed a stop string in: bounded work per
    # token, one search for all the strings (SamplingParams.stop_matcher).
    pattern, longest = seq.params.stop_matcher
    match = pattern.search(seq.text, max(len(seq.text) - piece_len - longest + 1, 0))
    if match is None:
        return False
    pos, stop = match.start(), match.group()
    seq.text = seq.text[: pos + len(stop)] if seq.params.include_stop_str_in_output else seq.text[:pos]
    seq.finish_reason = "stop"
    seq.stop_reason = stop
    return True


def visible_text(seq: DetokenizedSample) -> str:
    """Text safe to show now: while running, hold back what could still become a stop string."""
    if seq.is_finished or not seq.params.stop:
        return seq.text
    return seq.text[: visible_text_len(seq)]


def visible_text_len(seq: DetokenizedSample) -> int:
    """How much of ``seq.text`` is safe to show now (see visible_text), without copying it."""
    if seq.is_finished or not seq.params.stop:
        return len(seq.text)
    return max(len(seq.text) - (seq.params.stop_matcher[1] - 1), 0)
