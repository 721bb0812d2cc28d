"""Beam search's bookkeeping, as pure functions over beams and each beam's next-token candidates
(docs/server.md, "Beam search").

Beam search lives above the engine, as in vLLM v1: each step every live beam is one 1-token
request (its prompt is the request's prompt plus the beam's tokens, so the prefix cache serves
the prompt's and the parent beam's full blocks) asking for its top ``2 * beam_width`` logprobs,
and ``beam_step`` turns those candidates into the next live beams and the finished ones. The
drivers (the offline ``LLM.beam_search``, the HTTP front end's serving_beam.py) only submit
requests and read logprobs.

The rule is Hugging Face transformers' ``generate(num_beams=..., do_sample=False)``, so its
answers are the reference (tests/server/engine/test_beam_search.py):

- the candidates of every live beam are ranked together by cumulative logprob and the top
  ``2 * beam_width`` kept;
- a kept candidate that ends (a stop token or string, or ``max_tokens`` reached) becomes a
  finished hypothesis only if it ranks within the top ``beam_width``; the best ``beam_width``
  candidates that do not end are the next live beams;
- a hypothesis scores ``cum_logprob / len ** length_penalty``, ``len`` counting its generated
  tokens, the stop token included; the best ``beam_width`` hypotheses are kept;
- the search stops once ``beam_width`` hypotheses exist and, with ``early_stopping`` False
  (transformers' default and the server's), the best live beam scored at its current length
  cannot beat the worst of them; with True as soon as there are ``beam_width``; with "never"
  (and ``length_penalty`` > 0) its score at ``max_tokens`` is the bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

# vLLM's effective bound: its beam search asks for 2 * beam_width logprobs and a request may ask
# for at most 20 (max_logprobs), as here (SamplingParams.logprobs).
MAX_BEAM_WIDTH = 10

EarlyStopping = bool | Literal["never"]
# A candidate's generated tokens -> why it ends there (a stop token id or stop string), or None.
StopCheck = Callable[[tuple[int, ...]], "int | str | None"]


@dataclass(frozen=True)
class Beam:
    tokens: tuple[int, ...] = ()  # generated tokens only (the prompt is the driver's)
    cum_logprob: float = 0.0
    logprobs: tuple[float, ...] = ()  # each generated token's logprob
    finish_reason: str | None = None  # "stop" | "length" once a hypothesis
    stop_reason: int | str | None = None
    # Each generated token's step as the driver passed it to beam_step (the server's: the step's
    # top logprobs, which a request with logprobs answers); () when the driver passes none.
    steps: tuple[object, ...] = ()


def beam_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """A hypothesis's score: transformers' (and vLLM's) length normalization."""
    return cum_logprob / (max(length, 1) ** length_penalty)


@dataclass
class BeamSearchState:
    """One prompt's search: its live beams and its best finished hypotheses (best first)."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    live: list[Beam] = field(default_factory=lambda: [Beam()])
    finished: list[Beam] = field(default_factory=list)
    done: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")

    @property
    def num_logprobs(self) -> int:
        """The logprobs each live beam's 1-token request asks for."""
        return 2 * self.beam_width

    def score(self, beam: Beam) -> float:
        return beam_score(beam.cum_logprob, len(beam.tokens), self.length_penalty)

    def best(self) -> list[Beam]:
        """The answer: the finished hypotheses, best first."""
        return list(self.finished)


def beam_step(state: BeamSearchState, candidates: Sequence[Sequence[tuple[int, float]]],
              stop: StopCheck, steps: Sequence[object] | None = None) -> None:
    """Advance ``state`` by one token: ``candidates[i]`` is live beam i's (token, logprob) list,
    its top ``state.num_logprobs`` at least. ``stop`` says whether a candidate ends. ``steps[i]``,
    if given, is live beam i's step record, appended to its children's ``steps``."""
    if state.done:
        raise ValueError("the search is done")
    if len(candidates) != len(state.live):
        raise ValueError(f"{len(candidates)} candidate lists for {len(state.live)} live beams")
    if steps is not None and len(steps) != len(state.live):
        raise ValueError(f"{len(steps)} step records for {len(state.live)} live beams")
    width = state.beam_width
    joint = [(beam.cum_logprob + logprob, index, token, logprob)
             for index, (beam, options) in enumerate(zip(state.live, candidates, strict=True))
             for token, logprob in options]
    # Stable on ties: earlier beams, then the engine's order of its candidates.
    joint.sort(key=lambda c: -c[0])
    length = len(state.live[0].tokens) + 1
    full_before = len(state.finished) >= width
    live: list[Beam] = []
    ended: list[Beam] = []
    for rank, (cum, index, token, logprob) in enumerate(joint[:2 * width]):
        parent = state.live[index]
        tokens = parent.tokens + (token,)
        reason = stop(tokens)
        record = parent.steps + (steps[index],) if steps is not None else parent.steps
        beam = Beam(tokens, cum, parent.logprobs + (logprob,), steps=record)
        if reason is not None or length >= state.max_tokens:
            if rank < width:
                ended.append(Beam(tokens, cum, beam.logprobs, "stop" if reason is not None else "length",
                                  reason, record))
        elif len(live) < width:
            live.append(beam)
    if not (full_before and state.early_stopping is True):
        merged = state.finished + ended
        merged.sort(key=lambda b: -state.score(b))  # stable: the earlier hypothesis wins a tie
        state.finished = merged[:width]
    state.live = live
    state.done = not live or length >= state.max_tokens or _can_stop(state, length)


def _can_stop(state: BeamSearchState, length: int) -> bool:
    if len(state.finished) < state.beam_width:
        return False
    if state.early_stopping is True:
        return True
    bound = state.max_tokens if state.early_stopping == "never" and state.length_penalty > 0 else length
    best_live = beam_score(state.live[0].cum_logprob, bound, state.length_penalty)
    return best_live <= state.score(state.finished[-1])


def top_candidates(position: dict[int, float], count: int) -> list[tuple[int, float]]:
    """A position's ``count`` most likely (token, logprob), most likely first."""
    return sorted(position.items(), key=lambda item: -item[1])[:count]


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` for the offline ``LLM.beam_search``; ``early_stopping`` is
    kvscale's (transformers' meaning, above)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: EarlyStopping = False

    def __post_init__(self) -> None:
        # Scores are the model's own logprobs: a temperature would change nothing it could honour.
        if self.temperature != 0.0:
            raise ValueError(f"beam search scores the model's logprobs: temperature must be 0, "
                             f"got {self.temperature}")
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}")


@dataclass
class BeamSearchSequence:
    """One answer, as vLLM's: ``tokens`` the prompt's then the generated ones (the stop token
    only with ``include_stop_str_in_output``), ``text`` all of them decoded."""

    tokens: list[int]
    logprobs: list[float]  # each generated token's
    cum_logprob: float
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def stop_on(eos_token_ids: set[int] | frozenset[int], stop_token_ids: Sequence[int] = (),
            stop: Sequence[str] = (), decode: Callable[[list[int]], str] | None = None) -> StopCheck:
    """The ``StopCheck`` for EOS, stop token ids and stop strings (found in the decoded text)."""
    ends = frozenset(eos_token_ids) | frozenset(stop_token_ids)

    def check(tokens: tuple[int, ...]) -> int | str | None:
        if tokens[-1] in ends:
            return tokens[-1]
        if stop and decode is not None:
            text = decode(list(tokens))
            return next((s for s in stop if s in text), None)
        return None

    return check
