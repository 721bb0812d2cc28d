"""A chat prompt's token ids and block hashes without re-tokenizing the history every turn.

A follow-up turn's prompt is the previous turn's prompt, the answer and a new message, so
tokenizing each turn whole repeats the history's work: the cost grows with the history
(about 0.9 ms per 1,000 tokens with the bundled model's tokenizer), and hashing its blocks again
adds a little more. This cache keeps, per conversation text, the token ids and block hashes up to
the last special token of the rendered prompt (the opening of the assistant's turn), keyed by a
digest of that text; the next turn renders its template (cheap), finds the longest cached text
it starts with, and tokenizes and hashes only what comes after.

Why keys are rendered text, not messages: a template need not render a conversation's first
messages the same way whatever follows (some drop earlier reasoning, number turns, or add a
system prompt only when none is given), so a cache keyed by messages could return ids the
one-shot tokenization would not. Keyed by the exact text, a template that renders differently
simply misses.

Why cuts only after special tokens: the tokenizer splits its special tokens out of the text
before anything else and encodes the pieces between them one by one, so the ids of a text cut
right after a special token are the ids of the two halves, end to end; a cut anywhere else could
split a word the tokenizer would merge. That holds for byte-level BPE tokenizers like the bundled
model's; a tokenizer that treats the first piece of a text differently (a prepended space), or a
special token that swallows the whitespace after it, breaks it. So every cache checks its own
tokenizer when built, on conversations of many shapes, against the one-shot tokenization
(``kvscale.tokenization``, the server's own functions), and turns itself off on any
difference.
"""

from __future__ import annotations

import hashlib
import logging
import re
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvscale.block_hash import hash_prompt_blocks
from kvscale.tokenization import (
    chat_prompt_token_ids,
    chat_text_token_ids,
    render_chat_prompt,
)

log = logging.getLogger("kvscale.router")

DEFAULT_MAX_TOKENS = 4_000_000  # token ids held, all entries together: 16 MB as 32-bit ints
TAIL_MEMO_CHARS = 64  # what follows the last special token, memoised when this short


@dataclass
class _Entry:
    ids: array  # token ids of the cached text ('i': untracked by the garbage collector)
    hashes: array  # full-block hashes of those ids ('Q'), for `hashed_for` only
    hashed_for: tuple[int, str | None, str | None]  # (block size, cache salt, LoRA adapter)


def special_token_pattern(tokenizer: Any) -> re.Pattern | None:
    """Where the tokenizer itself splits the text: its special tokens matched on the raw text.

    A token that strips the whitespace after it (rstrip) would pull the next piece's first
    characters into its own match, so it is no cut point.
    """
    strings = [
        token.content for token in getattr(tokenizer, "added_tokens_decoder", {}).values()
        if token.special and not token.normalized and not token.rstrip and token.content
    ]
    if not strings:
        return None
    # Longest first: at one position the tokenizer matches the longest special token.
    return re.compile("|".join(re.escape(s) for s in sorted(set(strings), key=len, reverse=True)))


def _probe_conversations() -> list[list[dict]]:
    """Conversations of many shapes for the self-check, each grown turn by turn."""
    answers = ["Sure.", " Leading space and trailing space ", "Line one\nline two\n", "", "Ünïcödé — 漢字 🙂",
               "Tabs\tand  double  spaces.", "ends with a newline\n\n"]
    questions = ["Hello!", "What next?", "  indented question", "Why?\n", "数字 42 and 3.14", "ok", "<|im_end|> in text"]
    shapes: list[list[dict]] = []
    for system in (None, "You are terse.", ""):
        conversation: list[dict] = [] if system is None else [{"role": "system", "content": system}]
        for turn, question in enumerate(questions):
            conversation = [*conversation, {"role": "user", "content": question}]
            shapes.append(conversation)
            conversation = [*conversation, {"role": "assistant", "content": answers[turn % len(answers)]}]
    return shapes


class ChatTokenCache:
    """Token ids and block hashes of chat prompts, reusing the longest cached rendered prefix.

    ``max_tokens`` bounds the token ids held (least recently used entries go first); 0 turns the
    cache off, and so does a tokenizer that fails the self-check. Off, every call is the one-shot
    tokenization.
    """

    def __init__(self, tokenizer: Any, max_tokens: int = DEFAULT_MAX_TOKENS, tool_format: str = "hermes") -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.tool_format = tool_format
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._held = 0  # token ids in _entries
        self._cuts = special_token_pattern(tokenizer)
        # The text after the last special token is almost always the same ("assistant\n"): its
        # ids are kept, which saves a tokenizer call per request.
        self._tails: dict[str, list[int]] = {}
        self.hit_tokens = 0  # token ids taken from the cache instead of the tokenizer
        self.enabled = max_tokens > 0 and self._cuts is not None and self._self_check()

    def _self_check(self) -> bool:
        if getattr(self.tokenizer, "chat_template", None) is None:
            return False  # no chat prompts to serve
        self.enabled = True
        try:
            for messages in _probe_conversations():
                one_shot = chat_prompt_token_ids(self.tokenizer, messages)
                for _ in range(2):  # a miss that fills the cache, then the hit on the same text
                    if self.prompt(messages, 16, None)[0] != one_shot:
                        log.warning("chat token cache off: this tokenizer's ids differ when its prompt is cut "
                                    "after a special token; every chat turn is tokenized whole")
                        return False
        finally:
            self.clear()
        return True

    def clear(self) -> None:
        self._entries.clear()
        self._held = 0
        self._tails.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def prompt(self, messages: Any, block_size: int, cache_salt: str | None,
               tools: Any = None, lora_name: str | None = None) -> tuple[list[int], list[int]]:
        """(token ids, full-block hashes) of the chat prompt for ``messages`` and ``tools`` (the
        request's JSON) under the LoRA adapter ``lora_name`` (None: the base model); exactly what
        ``chat_prompt_token_ids`` and ``hash_prompt_blocks`` give.
        Raises ValueError for messages the template cannot take, as they do."""
        text = render_chat_prompt(self.tokenizer, messages, tools, self.tool_format)
        pattern = self._cuts if self.enabled else None
        cuts = [match.end() for match in pattern.finditer(text)] if pattern is not None else []
        if not cuts:
            ids = chat_text_token_ids(self.tokenizer, text)
            return ids, hash_prompt_blocks(ids, block_size, cache_salt=cache_salt, lora_name=lora_name)

        # One pass over the text gives the digest of every prefix ending at a cut.
        digests = []
        running = hashlib.blake2b(digest_size=16)
        previous = 0
        for cut in cuts:
            running.update(text[previous:cut].encode("utf-8", "surrogatepass"))
            digests.append(running.copy().digest())
            previous = cut
        start, entry = 0, None
        for cut, digest in zip(reversed(cuts), reversed(digests), strict=True):
            entry = self._entries.get(digest)
            if entry is not None:
                self._entries.move_to_end(digest)
                start = cut
                break

        last = cuts[-1]
        ids = list(entry.ids) if entry is not None else []
        self.hit_tokens += len(ids)
        if start < last:
            ids += chat_text_token_ids(self.tokenizer, text[start:last])
        through_last = len(ids)
        ids += self._tail_ids(text[last:])

        known: array | tuple = ()
        hashed_for = (block_size, cache_salt, lora_name)
        if entry is not None and entry.hashed_for == hashed_for:
            known = entry.hashes
        hashes = hash_prompt_blocks(ids, block_size, cache_salt=cache_salt, known=known, lora_name=lora_name)
        if start < last or (entry is not None and entry.hashed_for != hashed_for):
            self._store(digests[-1], ids[:through_last], hashes[: through_last // block_size], hashed_for)
        return ids, hashes

    def _tail_ids(self, tail: str) -> list[int]:
        ids = self._tails.get(tail)
        if ids is None:
            ids = chat_text_token_ids(self.tokenizer, tail)
            if len(tail) <= TAIL_MEMO_CHARS and len(self._tails) < 256:
                self._tails[tail] = ids
        return ids

    def _store(self, digest: bytes, ids: list[int], hashes: list[int],
               hashed_for: tuple[int, str | None, str | None]) -> None:
        old = self._entries.pop(digest, None)
        if old is not None:
            self._held -= len(old.ids)
        if len(ids) > self.max_tokens:
            return
        self._entries[digest] = _Entry(array("i", ids), array("Q", hashes), hashed_for)
        self._held += len(ids)
        while self._held > self.max_tokens:
            _, evicted = self._entries.popitem(last=False)
            self._held -= len(evicted.ids)
