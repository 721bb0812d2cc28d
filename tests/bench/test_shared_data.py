"""The benchmarks find their data in ../shared/data beside the checkout, wherever it is cloned,
and say what is missing when it is not there."""

from __future__ import annotations

import pytest

from bench.common import MOONCAKE_TRACE, REPO, shared_data
from bench.jsonschemabench import sample_path


def test_the_trace_and_the_sample_are_found_beside_the_checkout() -> None:
    trace = shared_data(*MOONCAKE_TRACE)
    assert trace.is_file() and trace.parent.parent.parent.name == "shared"
    assert REPO.is_relative_to(trace.parents[3])  # an ancestor of the checkout holds shared/
    assert sample_path() == shared_data("jsonschemabench", "sample.jsonl")


def test_missing_data_names_where_it_was_expected() -> None:
    with pytest.raises(FileNotFoundError, match=r"\.\./shared/data/traces/nothing-here\.jsonl"):
        shared_data("traces", "nothing-here.jsonl")
