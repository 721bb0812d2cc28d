"""The replica's step-rate averages (what its heartbeat reports for predicted TTFT), on plain
values."""

from __future__ import annotations

import pytest

from kvscale.server.core.step_rates import StepRates


def test_step_rates_time_decode_steps_and_prefill_net_of_the_decode_it_ran():
    rates = StepRates(alpha=0.5)
    rates.observe(0.02, prompt_tokens=0, decoding=4)
    assert rates.decode_step_s == pytest.approx(0.02)
    rates.observe(0.04, prompt_tokens=0, decoding=4)
    assert rates.decode_step_s == pytest.approx(0.03)
    # 512 prompt tokens in a 0.53 s step that also decoded: 0.5 s of prefill.
    rates.observe(0.53, prompt_tokens=512, decoding=4)
    assert rates.prefill_tokens_per_s == pytest.approx(1024.0)
    # A prefill-only step: all of it is prefill.
    rates.observe(0.25, prompt_tokens=512, decoding=0)
    assert rates.prefill_tokens_per_s == pytest.approx(512 / 0.375)
    assert rates.prefill_tokens == pytest.approx(512)
    # An idle "step" (nothing decoding, nothing prefilled) changes nothing.
    rates.observe(5.0, prompt_tokens=0, decoding=0)
    assert rates.decode_step_s == pytest.approx(0.03)
