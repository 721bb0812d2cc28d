"""How fast this engine prefills and decodes, averaged over its recent steps (heartbeat fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepRates:
    """Moving averages of this engine's speed, from the counters it reports after each step.

    ``observe`` gets one engine step: its wall time, the prompt tokens it computed and how many
    sequences were decoding in it. A step with no prompt tokens times a decode step; a step with
    prompt tokens times prefill, less the decode step it also ran. Rates are ratios of averaged
    tokens to averaged seconds, so a tiny step does not swing them.
    """

    alpha: float = 0.2
    decode_step_s: float = 0.0
    prefill_tokens: float = 0.0  # averaged prompt tokens per prefilling step
    prefill_seconds: float = 0.0  # averaged prefill seconds per prefilling step

    def observe(self, step_s: float, prompt_tokens: float, decoding: int) -> None:
        a = self.alpha
        if prompt_tokens <= 0:
            if decoding > 0:
                self.decode_step_s = step_s if self.decode_step_s == 0 else (1 - a) * self.decode_step_s + a * step_s
            return
        prefill_s = step_s - (self.decode_step_s if decoding > 0 else 0.0)
        prefill_s = max(prefill_s, 0.2 * step_s)  # a noisy decode average never makes prefill free
        if self.prefill_tokens == 0:
            self.prefill_tokens, self.prefill_seconds = prompt_tokens, prefill_s
        else:
            self.prefill_tokens = (1 - a) * self.prefill_tokens + a * prompt_tokens
            self.prefill_seconds = (1 - a) * self.prefill_seconds + a * prefill_s

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0
