"""Request bodies are read as strict JSON (server/entrypoints/request_json.py): what Python's ``json`` would
take beyond JSON is refused as FastAPI's JSON decode error; everything JSON holds comes through."""

from __future__ import annotations

import json

import pytest

from bench.jsonschemabench import load_rows
from kvscale.server.entrypoints import request_json


@pytest.mark.parametrize("text", ['{"a": NaN}', '{"a": Infinity}', '{"a": -Infinity}', '{"a": 1,}', "[1, 2"])
def test_what_is_not_json_is_a_json_decode_error(text: str) -> None:
    with pytest.raises(json.JSONDecodeError):
        request_json.loads(text.encode())


def test_json_nested_past_the_decoders_depth_is_a_json_decode_error() -> None:
    # msgspec gives up with RecursionError: uncaught, it was a 500 (and a logged traceback).
    with pytest.raises(json.JSONDecodeError):
        request_json.loads(b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")


def test_json_values_come_through_as_pythons_json_reads_them() -> None:
    text = '{"big": 100000000000000000000000000001, "small": 1e-7, "text": "é\\u2028\\ud83d\\ude00", "n": null}'
    assert request_json.loads(text) == json.loads(text)


def test_the_compact_form_reads_back_the_same_for_every_schema_of_the_sample() -> None:
    rows = load_rows(None)
    assert rows
    for row in rows:
        compact = request_json.dumps_compact(row["schema"])
        assert json.loads(compact) == row["schema"], row["id"]
        assert list(json.loads(compact)) == list(row["schema"])  # key order kept: it orders the grammar
