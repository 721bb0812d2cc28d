"""`kvscale serve` flags refused before anything starts (no model load, no engine core)."""

from __future__ import annotations

from kvscale.cli import build_parser
from kvscale.server.entrypoints.cli_serve import run


def test_a_stream_interval_below_one_is_refused_before_anything_starts(capsys):
    assert run(build_parser("serve").parse_args(["serve", "--stream-interval", "0"])) == 2
    assert "--stream-interval must be at least 1" in capsys.readouterr().err
    assert build_parser("serve").parse_args(["serve"]).stream_interval == 1
