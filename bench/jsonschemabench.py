"""The shared JSONSchemaBench sample (``../shared/data/jsonschemabench/sample.jsonl``), read where
it lies beside the checkout; never copied into the repository. The benchmarks read it and so do
the structured-output tests (bench code may be imported by tests, never the other way round).
Missing: whoever asked fails loudly."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.common import shared_data

SAMPLE_ENV = "KVSCALE_JSONSCHEMABENCH"


def sample_path() -> Path:
    """``$KVSCALE_JSONSCHEMABENCH``, else ``shared/data/...`` beside the nearest ancestor of this
    file that has one: a worktree or clone nested under /work finds /work/shared too."""
    if os.environ.get(SAMPLE_ENV):
        return Path(os.environ[SAMPLE_ENV])
    try:
        return shared_data("jsonschemabench", "sample.jsonl")
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{exc} (or set {SAMPLE_ENV}, or pass --sample)") from None


def load_rows(path: Path | str | None = None) -> list[dict]:
    """Every row of the sample at ``path`` (default: sample_path()), in file order."""
    with open(path or sample_path()) as f:
        return [json.loads(line) for line in f]


def rows_per_set(rows: list[dict], per_set: int) -> list[dict]:
    """The first ``per_set`` rows of every set, in file order."""
    taken: dict[str, int] = {}
    chosen = []
    for row in rows:
        if taken.get(row["set"], 0) < per_set:
            taken[row["set"]] = taken.get(row["set"], 0) + 1
            chosen.append(row)
    return chosen
