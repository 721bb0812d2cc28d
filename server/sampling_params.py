"""Per-request sampling settings, validated where they are built so bad input fails early."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """One constraint on what a request may generate (vLLM's ``structured_outputs``), as plain
    data: the engine compiles it (kvscale.server.structured_outputs), the HTTP side only builds it.

    Exactly one of the constraint fields is set. ``json`` is the schema as the request sent it,
    serialized compactly, which with ``disable_additional_properties`` is also the compile cache's
    key. ``disable_additional_properties`` (vLLM's name) is ``strict: true``: the compile worker
    closes the objects the schema leaves open (strict_schema.py), so the HTTP side never walks a
    schema (a large one takes tens of milliseconds of its event loop).
    """

    json: str | None = None
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF (converted by the library)
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        set_kinds = [kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                f"got {', '.join(set_kinds) or 'none'}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.disable_additional_properties and self.json is None:
            raise ValueError("disable_additional_properties applies to a json schema only")

    @property
    def kind(self) -> str:
        return next(kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False))

    def text_bytes(self) -> int:
        """The constraint's size as sent (docs/server.md "Request limits")."""
        texts = self.choice if self.choice is not None else [self.json or self.regex or self.grammar or ""]
        return sum(len(text.encode()) for text in texts)


def stop_matcher(stop: list[str]) -> tuple[re.Pattern[str], int]:
    """One alternation of the stop strings, in their order: a search finds the leftmost match and,
    of those starting there, the first listed, in one pass in C however many strings there are
    (their number and length are bounded, docs/server.md "Request limits")."""
    return re.compile("|".join(map(re.escape, stop))), max(map(len, stop), default=0)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: chosen token plus top-k alternatives
    prompt_logprobs: int | None = None  # the same, for every prompt token after the first
    skip_special_tokens: bool = True
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias, in [-100, 100]).
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    def validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        if self.n < 1:
            raise bad("n", "at least 1")
        if self.temperature < 0:
            raise bad("temperature", "non-negative")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "-1 (disabled) or positive")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "positive")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "in [-2, 2]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "at least 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", "in [0, 20]")
        if self.logit_bias is not None and any(not -100 <= v <= 100 for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """These parameters for another prompt of the same request: the request-wide fields
        (stop, stop_token_ids, logit_bias, structured_outputs) shared, not copied, and nothing
        validated again but what changed (docs/server.md "Request limits")."""
        if self.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens})")
        params = copy.copy(self)
        params.max_tokens = max_tokens
        return params

    def derived(self, name: str, source: Any, build: Callable[[Any], T]) -> T:
        """``build(source)`` for a field's value ``source``, built once and kept on these params
        while the field holds that very object: what the step loop reads every step (a set of
        the stop ids, logit_bias as tensors) is made once per request, not per step."""
        cached = self.__dict__.get(name)
        if cached is None or cached[0] is not source:
            cached = self.__dict__[name] = (source, build(source))
        return cached[1]

    @property
    def stop_matcher(self) -> tuple[re.Pattern[str], int]:
        """The stop strings as one pattern, and the longest one's length (server/engine/detokenizer.py)."""
        return self.derived("_stop_matcher", self.stop, stop_matcher)

    @property
    def stop_token_set(self) -> frozenset[int]:
        return self.derived("_stop_token_set", self.stop_token_ids, frozenset)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
