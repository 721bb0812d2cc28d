"""The grammar library behind one narrow interface: llguidance.

Why llguidance (measured on the shared JSONSchemaBench sample, docs/server.md and
``bench/grammar_libraries.py``): it enforces a schema exactly or refuses it, naming the keyword
("Unimplemented keys: ["uniqueItems"]", "Unknown format: ..."), compiles in about a millisecond,
and accepted no invalid test instance; xgrammar compiled every schema but accepted invalid
instances and rejected valid ones (keywords it drops or approximates), and compiles slower.

Everything the rest of kvscale needs from a library is here: a tokenizer view built once,
``grammar_text`` (a request's constraint to the library's grammar), ``compile_grammar`` (the
expensive part: lexer and token trie, run in the compile pool) and ``Matcher`` (one per sequence).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from kvscale.server.sampling_params import StructuredOutputsParams
from kvscale.server.structured_outputs.schema_rewrites import rewrite_schema
from kvscale.server.structured_outputs.strict_schema import close_objects

# Between JSON tokens: nothing, one space, or a newline and up to 16 spaces of indentation. A
# bounded pattern means a small model can never loop on whitespace until max_tokens (the
# libraries' default, any run of whitespace, lets it), while pretty-printed JSON stays possible.
JSON_WHITESPACE = r"(\n {0,16}| )"
JSON_OPTIONS: Any = {"whitespace_pattern": JSON_WHITESPACE}  # llguidance's JsonCompileOptions


class GrammarError(ValueError):
    """A constraint the library cannot enforce exactly, or cannot parse; the message says why."""


def build_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> Any:
    """The library's view of the tokenizer (about half a second: build once per engine)."""
    # Every end-of-sequence id ends the grammar: the chat model ends a turn with <|im_end|>, a
    # plain completion with <|endoftext|>.
    return llguidance.LLTokenizer(hf_tokenizer.backend_tokenizer.to_str(), n_vocab=vocab_size,
                                  eos_token=sorted(eos_token_ids))


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The library's grammar for a request's constraint (cheap: no tokenizer work yet)."""
    try:
        if spec.json is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(
                library_schema(spec.json, close=spec.disable_additional_properties), defaults=JSON_OPTIONS)
        if spec.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(choice) for choice in spec.choice))
        assert spec.grammar is not None
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as exc:
        raise GrammarError(str(exc)) from exc


def library_schema(schema: str | dict[str, Any], close: bool = False) -> str | dict[str, Any]:
    """What the library is given for a request's schema: with ``close`` (``strict: true``) its
    open objects closed where that is proven to only remove instances (strict_schema.py), then
    the keywords the library refuses rewritten into exact equivalents where that is proven
    (schema_rewrites.py), else unchanged, so its refusal still names the keyword. A function of
    the schema and ``close`` alone, so the compile cache's key (the request's schema text and
    the flag) stands for the rewritten schema too."""
    parsed = json.loads(schema) if isinstance(schema, str) else schema
    closed = close_objects(parsed) if close else parsed
    rewritten = rewrite_schema(closed)
    return schema if rewritten == parsed else rewritten


def schema_refusal(schema: dict[str, Any]) -> str | None:
    """Why the library cannot enforce ``schema`` exactly (the keyword it names), or None. Needs
    no tokenizer: a refusal is the schema's, whatever the vocabulary (about a millisecond)."""
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(library_schema(schema), defaults=JSON_OPTIONS)
    except ValueError as exc:
        return _first_line(str(exc))
    error = llguidance.LLMatcher.validate_grammar(text, None)
    return _first_line(error) if error else None


def compile_grammar(tokenizer: Any, text: str) -> Any:
    """A pristine matcher for ``text``; every sequence gets its own copy (``Matcher.of``)."""
    matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
    if matcher.is_error():
        raise GrammarError(_first_line(matcher.get_error()))
    return matcher


def _first_line(error: str) -> str:
    # The library appends its parser state and the whole grammar; the first line says what failed.
    return error.strip().splitlines()[0] if error.strip() else "the grammar could not be compiled"


class Matcher:
    """One sequence's position in its grammar."""

    __slots__ = ("_m",)

    def __init__(self, inner: Any) -> None:
        self._m = inner

    @classmethod
    def of(cls, compiled: Any) -> Matcher:
        return cls(compiled.deep_copy())

    def copy(self) -> Matcher:
        return Matcher(self._m.deep_copy())

    def fill_bitmask(self, bitmask_row_ptr: int, num_bytes: int) -> None:
        self._m.unsafe_compute_mask_ptr(bitmask_row_ptr, num_bytes)

    def consume(self, token: int) -> bool:
        return bool(self._m.consume_token(token))

    def rollback(self, num_tokens: int) -> bool:
        return bool(self._m.rollback(num_tokens))

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar allows as the only continuation from here (its forced bytes,
        canonically tokenized, less a last token that a longer one could still replace); not
        consumed. Empty where the next token is a real choice."""
        return list(self._m.compute_ff_tokens())

    def is_accepting(self) -> bool:
        return bool(self._m.is_accepting())

    def is_stopped(self) -> bool:
        """Nothing but end-of-sequence can follow: the grammar is complete."""
        return bool(self._m.is_stopped())

    def is_error(self) -> bool:
        return bool(self._m.is_error())

    def error(self) -> str:
        return _first_line(self._m.get_error())


def fill_bitmasks(matchers: list[Matcher], bitmask: Any, executor: Any | None) -> None:
    """Row i of ``bitmask`` (int32, contiguous, on the CPU) gets the allowed tokens of matchers[i];
    with an executor, rows are filled by the library's own threads (the GIL released)."""
    row_bytes = bitmask.shape[1] * 4
    if executor is not None and len(matchers) > 1:
        executor.unsafe_compute_mask_ptr([(m._m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                         row_bytes, len(matchers))
        return
    for i, matcher in enumerate(matchers):
        matcher.fill_bitmask(bitmask[i].data_ptr(), row_bytes)


def make_executor(threads: int) -> Any | None:
    return llguidance.LLExecutor(threads) if threads > 1 else None
