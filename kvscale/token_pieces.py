"""Encoding a long text piece by piece, where the tokenizer provably splits, each piece's ids kept.

Prompts that share a prefix (a system prompt, a document, a conversation so far) are tokenized
again on every request, by the router and by the server: ~0.45 ms for 2 KB of text here, most
of what the router adds to a request. A byte-level BPE tokenizer never merges across the words
its pre-tokenizer's regex finds, and those regexes (GPT-2's, Llama 3's, Qwen 2's) always end a
word before a space that lies between two ASCII letters and start the next at that space: no
alternative matches a letter followed by a space. Cut there, the pieces encode to exactly the
ids of the whole, so a prefix's pieces are encoded once and looked up after.

Cuts are chosen from the start of the text (the first such space at least ``PIECE_CHARS`` after
the previous cut), so texts sharing a prefix share its pieces. Only tokenizers whose
``tokenizer.json`` shows the conditions hold are cut (``cuts_safely``): no normalizer, a BPE
model without dropout, one of those pre-tokenizers, no added token holding whitespace or
absorbing it on its right, and a post-processor that adds special tokens, if any, only in front.
"""

from __future__ import annotations

import re
import threading
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

from tokenizers import pre_tokenizers

# The characters between cuts (about 60 tokens of English): small enough that a request's own
# text costs little beyond its prefix, large enough that a piece's lookup is cheaper than it.
PIECE_CHARS = 256
# Pieces kept (least recently used dropped): ~2 MB of text and ids at PIECE_CHARS.
MAX_PIECES = 8192
# Characters of the pieces kept, at most: a piece runs to the first cut past PIECE_CHARS, so a text
# with no space between letters for a long stretch (code, digits, CJK) makes one long piece, and
# the count of pieces alone would not bound what clients' prompts keep here.
MAX_CHARS = 2 * MAX_PIECES * PIECE_CHARS
# Hashes of pieces met (whether kept or not) remembered, per piece kept.
SEEN_PER_PIECE = 4

_CUT = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")

# The word regexes of Split pre-tokenizers known to cut as described above (Llama 3's, and Qwen
# 2's, which takes single digits).
_WORD_REGEXES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def _word_splitter(step: Any) -> bool | None:
    """True: ``step`` splits words as required; False: it keeps pieces apart without changing
    them (digits, byte mapping alone); None: anything else."""
    if not isinstance(step, dict):
        return None
    kind = step.get("type")
    if kind == "ByteLevel":
        return None if step.get("add_prefix_space") else bool(step.get("use_regex", True))
    if kind == "Digits":
        return False
    if kind == "Split":
        pattern = step.get("pattern")
        regex = pattern.get("Regex") if isinstance(pattern, dict) else None
        if regex in _WORD_REGEXES and step.get("behavior") == "Isolated" and not step.get("invert"):
            return True
    return None


def _prefix_specials(post: Any) -> list[int] | None:
    """The ids ``post`` (a post-processor) puts before a single text, or None where it adds
    anything elsewhere or does something else."""
    if not isinstance(post, dict):
        return None
    kind = post.get("type")
    if kind == "ByteLevel":
        return []
    if kind == "Sequence":
        steps = post.get("processors") or []
        prefixes = [_prefix_specials(step) for step in steps]
        if any(prefix is None for prefix in prefixes) or sum(1 for p in prefixes if p) > 1:
            return None
        return next((p for p in prefixes if p), [])
    if kind != "TemplateProcessing":
        return None
    single, specials = post.get("single") or [], post.get("special_tokens") or {}
    ids: list[int] = []
    for n, item in enumerate(single):
        if "Sequence" in item:
            return ids if n == len(single) - 1 and item["Sequence"].get("id") == "A" else None
        token = specials.get(item.get("SpecialToken", {}).get("id"))
        if not isinstance(token, dict) or not token.get("ids"):
            return None
        ids.extend(int(i) for i in token["ids"])
    return None


def cuts_safely(data: dict) -> list[int] | None:
    """For a parsed ``tokenizer.json``: the special-token ids a single text gets in front when
    the tokenizer may be cut as this module does, else None."""
    model = data.get("model")
    if data.get("normalizer") is not None or not isinstance(model, dict):
        return None
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
        return None
    pre = data.get("pre_tokenizer")
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    kinds = [_word_splitter(step) for step in steps or []]
    if any(kind is None for kind in kinds) or kinds.count(True) != 1:
        return None
    # Byte-level tokens: a token's string is its bytes, one character each (byte_lengths). A byte
    # missing from the vocabulary must be dropped, not become a token of another length, so that
    # the lengths of a text's tokens add up to its own only where every byte is kept (split_ids).
    if not any(isinstance(step, dict) and step.get("type") == "ByteLevel" for step in steps or []):
        return None
    vocab = model.get("vocab")
    every_byte = isinstance(vocab, dict) and set(pre_tokenizers.ByteLevel.alphabet()) <= vocab.keys()
    if not every_byte and (model.get("unk_token") is not None or model.get("byte_fallback")):
        return None
    for token in data.get("added_tokens") or []:
        content = token.get("content")
        if not isinstance(content, str) or token.get("rstrip") or any(c.isspace() for c in content):
            return None
    return _prefix_specials(data.get("post_processor"))


def cut_points(text: str, every: int = PIECE_CHARS) -> list[int]:
    """Where ``text`` is cut: each cut the first space between ASCII letters at least ``every``
    characters after the previous one (or the start)."""
    cuts, at = [], 0
    while (found := _CUT.search(text, at + every)) is not None:
        at = found.start()
        cuts.append(at)
    return cuts


def byte_lengths(vocab: dict[str, int], added: dict[int, str]) -> list[int]:
    """Each token id's length in the text's UTF-8 bytes: a byte-level token's string holds one
    character per byte, an added token is its content."""
    lengths = [0] * (max(vocab.values(), default=-1) + 1)
    for token, token_id in vocab.items():
        lengths[token_id] = len(token)
    for token_id, content in added.items():
        if token_id < len(lengths):
            lengths[token_id] = len(content.encode())
    return lengths


def split_ids(ids: Sequence[int], lengths: Sequence[int], byte_cuts: list[int],
              total: int) -> list[Sequence[int]] | None:
    """``ids`` of a text of ``total`` UTF-8 bytes, cut where the text is cut (``byte_cuts``,
    increasing offsets); None where a cut falls inside a token or the lengths do not add up."""
    try:
        ends = list(accumulate(lengths[token_id] for token_id in ids))
    except IndexError:
        return None
    if not ends or ends[-1] != total:
        return None
    parts, start = [], 0
    for cut in byte_cuts:
        at = bisect_left(ends, cut)
        if at == len(ends) or ends[at] != cut:
            return None
        parts.append(ids[start:at + 1])
        start = at + 1
    parts.append(ids[start:])
    return parts


class PieceCache:
    """Token ids of texts, by pieces. ``encode_batch`` encodes texts without special tokens;
    ``lengths`` is byte_lengths' table of the same tokenizer."""

    def __init__(self, encode_batch: Callable[[list[str]], Sequence[Sequence[int]]], prefix_specials: list[int],
                 lengths: Sequence[int], every: int = PIECE_CHARS, max_pieces: int = MAX_PIECES,
                 max_chars: int = MAX_CHARS) -> None:
        self._encode_batch = encode_batch
        self.prefix_specials = prefix_specials
        self._lengths = lengths
        self.every = every
        self.max_pieces = max_pieces
        self.max_chars = max_chars
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0  # of the pieces kept
        self._seen: OrderedDict[int, None] = OrderedDict()  # hashes of pieces met, kept or not
        # The router encodes on its event loop and, for long prompts, in a worker thread.
        self._lock = threading.Lock()
        self.hits = 0  # pieces found
        self.misses = 0  # pieces encoded and kept
        self.unseen = 0  # texts encoded whole, none of their pieces seen before

    def __len__(self) -> int:
        return len(self._pieces)

    def ids(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """``text``'s ids, or None when the caller should encode it whole: it is too short to cut,
        or none of its pieces was seen before (a prompt sharing nothing: keeping its pieces would
        only push out pieces that do recur).

        The text is encoded from its first piece not kept to its end, in one call: no more than
        encoding it whole, and no less where a piece is missing; those ids are cut into pieces to
        keep (the last piece is the request's own: seldom seen again)."""
        cuts = cut_points(text, self.every)
        if not cuts:
            return None
        bounds = [0, *cuts, len(text)]
        shared = [text[start:end] for start, end in zip(bounds, cuts, strict=False)]
        with self._lock:
            found = [self._pieces.get(piece) for piece in shared]
            first = next((n for n, ids in enumerate(found) if ids is None), len(shared))
            for piece in shared[:first]:
                self._pieces.move_to_end(piece)
            self.hits += first
            if first == 0 and not any(hash(piece) in self._seen for piece in shared):
                self._seen.update(dict.fromkeys(map(hash, shared)))
                while len(self._seen) > SEEN_PER_PIECE * self.max_pieces:
                    self._seen.popitem(last=False)
                self.unseen += 1
                return None
        run = text[bounds[first]:]
        ids = self._encode_batch([run])[0]
        if first < len(shared):
            self._keep(shared[first:], run, ids, [cut - bounds[first] for cut in cuts[first:]])
        out = list(self.prefix_specials) if add_special_tokens else []
        for kept in found[:first]:
            out.extend(kept or ())
        out.extend(ids)
        return out

    def _keep(self, pieces: list[str], run: str, ids: Sequence[int], char_cuts: list[int]) -> None:
        """Keep ``pieces`` (all of ``run`` but its last piece), cut out of ``run``'s ``ids``."""
        if run.isascii():
            byte_cuts, total = char_cuts, len(run)
        else:
            byte_cuts, total = [len(run[:cut].encode()) for cut in char_cuts], len(run.encode())
        parts = split_ids(ids, self._lengths, byte_cuts, total)
        if parts is None:
            parts = list(self._encode_batch(pieces))
        with self._lock:
            for piece, part in zip(pieces, parts, strict=False):
                if piece not in self._pieces:
                    self._chars += len(piece)
                self._pieces[piece] = tuple(part)
            self.misses += len(pieces)
            while self._pieces and (len(self._pieces) > self.max_pieces or self._chars > self.max_chars):
                gone, _ = self._pieces.popitem(last=False)
                self._chars -= len(gone)

    @property
    def chars(self) -> int:
        """The characters of the pieces kept."""
        return self._chars
