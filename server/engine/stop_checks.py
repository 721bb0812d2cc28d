"""Whether a token just appended ends its sample, and why: the end-of-sequence checks of a step.

vLLM's order (docs/server.md "Sampling parameters"): nothing stops a sample before ``min_tokens``
but a grammar with nothing left to accept and the length limits; then end-of-sequence (unless
``ignore_eos``), a stop token id, a stop string completed by the latest text; then a finished
grammar; then ``max_tokens`` or the model's length.
"""

from __future__ import annotations

from kvscale.server.core.sequence import Sequence
from kvscale.server.engine.detokenizer import find_stop_string


def check_stop(seq: Sequence, token: int, *, piece_len: int, grammar_done: bool,
               eos_token_ids: set[int], max_model_len: int) -> None:
    """Set ``seq.finish_reason`` (and ``stop_reason`` for a stop token) when ``token``, the last
    of ``seq.token_ids``, ends it; ``piece_len`` is the length of the text it added (0 when the
    core does not detokenize: the front end then checks the stop strings)."""
    params = seq.params
    if seq.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in eos_token_ids:
            seq.finish_reason = "stop"
            return
        if token in params.stop_token_set:
            seq.finish_reason = "stop"
            seq.stop_reason = token
            return
        if find_stop_string(seq, piece_len):
            return
    if grammar_done:
        # Nothing but end-of-sequence can follow: the answer is complete.
        seq.finish_reason = "stop"
        return
    if seq.num_output_tokens >= seq.request.max_tokens or seq.num_tokens >= max_model_len:
        seq.finish_reason = "length"
