"""N-gram (prompt lookup) drafts: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, for n from ``max_n`` down to ``min_n``. No draft model: output that
copies or edits its input (quoting, code edits, summaries) repeats the context's own runs."""

from __future__ import annotations

from array import array

_ITEM = array("i").itemsize


def propose_ngram(tokens: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_tokens`` draft tokens continuing ``tokens``; [] when no n-gram of the suffix
    (longest first) occurred earlier. The search runs as a byte search in C (``bytes.rfind``)
    over the packed ids, since a Python scan of a long context each step would cost more than
    the step saves; a hit at an offset that is not a whole token is skipped."""
    length = len(tokens)
    if num_tokens < 1 or length <= min_n:
        return []
    packed = array("i", tokens).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = packed[(length - n) * _ITEM:]
        # The match must end before the suffix's last token, so at least one token follows it.
        end = (length - 1) * _ITEM
        while (found := packed.rfind(pattern, 0, end)) >= 0:
            if found % _ITEM == 0:
                start = found // _ITEM + n
                return tokens[start:start + num_tokens]
            end = found + len(pattern) - 1
    return []
