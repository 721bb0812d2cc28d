"""Suffix decoding drafts (Arctic Inference's method; vLLM's ``"method": "suffix"``): match the
sequence's latest tokens against its own earlier tokens (prompt and output so far) and against
earlier responses (server/core/suffix_tree.py), and draft the continuation most often seen after
the match, while the share of matches that continued that way stays at least ``min_token_prob``.

The draft's length adapts to the match: a match of ``m`` tokens drafts at most
``floor(m * max_spec_factor)`` tokens, and the match plus the draft fit in ``max_depth`` tokens.
Every match length from 1 to ``max_depth - 1`` is tried, in both sources; the draft with the
highest score (the sum of its tokens' shares: the expected number accepted) wins, a longer match
and then the sequence's own tokens on ties.

The sequence's own tokens are searched where they lie rather than held in a tree per sequence:
the answer a suffix tree over them would give (the occurrences of the match that continue, their
next tokens counted), without memory that grows with every running sequence. Occurrences whose
continuation runs past the sequence's end are not counted (their next token is not known yet).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvscale.server.core.suffix_tree import ResponseSuffixTree


@dataclass(frozen=True)
class SuffixDraft:
    tokens: list[int]
    score: float
    match_len: int


NO_DRAFT = SuffixDraft([], 0.0, 0)


def draft_length(match_len: int, max_tokens: int, max_depth: int, max_spec_factor: float) -> int:
    """How many tokens a match of ``match_len`` may draft."""
    return max(0, min(max_tokens, int(match_len * max_spec_factor + 1e-6), max_depth - match_len))


def _own_continuation(tokens: list[int], ends: list[int], max_tokens: int,
                      min_token_prob: float) -> tuple[list[int], float]:
    """The most frequent continuation after the occurrences ending at ``ends``; ties: the one
    after the latest occurrence."""
    length = len(tokens)
    draft: list[int] = []
    score, prob = 0.0, 1.0
    live = ends
    for step in range(1, max_tokens + 1):
        known = [end for end in live if end + step < length]
        if not known:
            break
        counts = Counter(tokens[end + step] for end in known)
        best = max(counts.values())
        token = next(tokens[end + step] for end in reversed(known) if counts[tokens[end + step]] == best)
        prob *= best / len(known)
        if prob < min_token_prob:
            break
        draft.append(token)
        score += prob
        live = [end for end in known if tokens[end + step] == token]
    return draft, score


def propose_from_own_tokens(tokens: list[int], max_tokens: int, max_depth: int, max_spec_factor: float,
                            min_token_prob: float) -> SuffixDraft:
    """The best draft from the sequence's own earlier tokens."""
    length = len(tokens)
    if length < 2 or max_tokens < 1:
        return NO_DRAFT
    last = tokens[-1]
    # Ends of the earlier occurrences of the last token, found by the C scan of list.index.
    ends: list[int] = []
    at = 0
    try:
        while True:
            at = tokens.index(last, at, length - 1)
            ends.append(at)
            at += 1
    except ValueError:
        pass
    best = NO_DRAFT
    match_len = 1
    while ends and match_len < max_depth:
        room = draft_length(match_len, max_tokens, max_depth, max_spec_factor)
        if room:
            draft, score = _own_continuation(tokens, ends, room, min_token_prob)
            if draft and score >= best.score:
                best = SuffixDraft(draft, score, match_len)
        match_len += 1
        if match_len > length - 1:
            break
        # Occurrences of the one-longer match: those whose preceding token agrees too.
        want = tokens[length - match_len]
        ends = [end for end in ends if end - match_len + 1 >= 0 and tokens[end - match_len + 1] == want]
    return best


def propose_from_responses(tree: ResponseSuffixTree, tokens: list[int], max_tokens: int,
                           max_spec_factor: float, min_token_prob: float) -> SuffixDraft:
    """The best draft from the cached responses."""
    best = NO_DRAFT
    for match_len in range(1, min(tree.max_depth, len(tokens) + 1)):
        node = tree.match(tokens[len(tokens) - match_len:])
        if node is None:
            break  # a longer match holds this one: none further
        room = draft_length(match_len, max_tokens, tree.max_depth, max_spec_factor)
        if room:
            draft, score = tree.continuation(node, room, min_token_prob)
            if draft and score >= best.score:
                best = SuffixDraft(draft, score, match_len)
    return best


def propose_suffix(tokens: list[int], tree: ResponseSuffixTree | None, max_tokens: int, max_depth: int,
                   max_spec_factor: float, min_token_prob: float) -> list[int]:
    """Up to ``max_tokens`` draft tokens continuing ``tokens``; [] when nothing matched well enough."""
    if max_tokens < 1:
        return []
    own = propose_from_own_tokens(tokens, max_tokens, max_depth, max_spec_factor, min_token_prob)
    if tree is not None and tree.responses:
        cached = propose_from_responses(tree, tokens, max_tokens, max_spec_factor, min_token_prob)
        if cached.score > own.score:
            return cached.tokens
    return own.tokens
