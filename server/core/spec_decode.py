"""Speculative decoding's two decisions, as pure functions: how many draft tokens the target model
confirmed, and whether a step speculates at all.

Verification (greedy): one step computes the sequence's last token and its K drafts as one chunk,
so the logits at each of those K + 1 positions give the target's own next token there. Draft i
is kept while it equals the target's token at the position before it; the first mismatch ends
the run, and the target's token at that position is appended too (a correct token, the one a
plain decode step would have produced). So every step appends 1 to K + 1 tokens, each exactly
the token greedy decoding picks.
"""

from __future__ import annotations


def num_accepted(drafts: list[int], targets: list[int]) -> int:
    """Leading drafts equal to the target's token before them: ``targets[i]`` is the target's
    argmax at the position of ``drafts[i]`` (``len(targets) == len(drafts) + 1``)."""
    assert len(targets) == len(drafts) + 1, "one target per draft, and the one after the last"
    accepted = 0
    for draft, target in zip(drafts, targets, strict=False):
        if draft != target:
            break
        accepted += 1
    return accepted


def speculate_this_step(num_decoding: int, disable_by_batch_size: int) -> bool:
    """Whether this step verifies drafts: only while at most ``disable_by_batch_size`` sequences
    decode (vLLM's key of that name). A small batch's step reads every weight for a handful of
    rows, so K more rows per sequence ride along nearly free; a large batch already fills the
    matrix units, and its rejected rows would cost as much as real ones."""
    return 0 < num_decoding <= disable_by_batch_size
