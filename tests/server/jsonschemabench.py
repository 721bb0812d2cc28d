"""The shared JSONSchemaBench sample (``../shared/data/jsonschemabench/sample.jsonl``), read where
it lies beside the checkout; never copied into the repository. Missing: the tests fail loudly."""

from __future__ import annotations

import json
from pathlib import Path

SAMPLE_ENV = "KVSCALE_JSONSCHEMABENCH"


def sample_path() -> Path:
    import os

    if os.environ.get(SAMPLE_ENV):
        return Path(os.environ[SAMPLE_ENV])
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "shared" / "data" / "jsonschemabench" / "sample.jsonl"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        "the JSONSchemaBench sample is missing: expected ../shared/data/jsonschemabench/sample.jsonl "
        f"beside the checkout (or set {SAMPLE_ENV})")


def load_rows() -> list[dict]:
    with open(sample_path()) as f:
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
