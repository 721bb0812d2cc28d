"""Two commits in one run. A benchmark's "before" side runs another commit's code from a git
worktree of it, in a child process whose imports come from that tree:

    git worktree add --detach /tmp/kv-before HEAD~1
    python -m bench.<benchmark> --before-checkout /tmp/kv-before

This is how a change is measured against its parent: shipped code keeps no switch that brings an
old code path back for a benchmark. The sides alternate from round to round, so neither always
runs on a cooler or a warmer machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path
from typing import Any

from bench.common import REPO, git_commit

SIDES = ("before", "after")


def add_before_checkout(parser: argparse.ArgumentParser, required: bool = False,
                        help: str = "the other tree (a git worktree of an earlier commit)") -> None:
    parser.add_argument("--before-checkout", type=Path, required=required, default=None, metavar="PATH", help=help)


def run_json(argv: list[str], checkout: Path, env: dict[str, str]) -> Any:
    """``argv`` run in ``checkout``; the last line it prints, as JSON."""
    done = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:3]} in {checkout} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def order(round_id: int) -> list[str]:
    """The sides of one round: before first in even rounds, after first in odd ones."""
    return list(SIDES) if round_id % 2 == 0 else list(reversed(SIDES))


def checkout_of(side: str, before: Path) -> Path:
    return before if side == "before" else REPO


def commits(before: Path | None) -> dict[str, str | None]:
    return {"after": git_commit(REPO), "before": git_commit(before) if before else None}


def median_ratio(rounds: list[dict[str, Any]], value: Any) -> dict[str, float]:
    """Each side's median of ``value(side's entry)`` over ``rounds``, and before ÷ after."""
    medians = {side: statistics.median(value(entry[side]) for entry in rounds) for side in SIDES}
    return {**medians, "before_over_after": medians["before"] / medians["after"]}
