"""The one check of a generation request's JSON that the router's HTTP path and its endpoint picker
both make before ranking (kvscale.router.errors.request_json)."""

from __future__ import annotations

import json

import pytest
from starlette.responses import Response

from kvscale.router.errors import request_json
from kvscale.router.ext_proc import parse_body
from kvscale.router.ext_proc_messages import Refusal


@pytest.mark.parametrize(("raw", "message"), [
    (b"{not json", "invalid JSON body"),
    (b"[1, 2]", "the request body must be a JSON object"),
    (b'{"model": 7, "prompt": "x"}', "model must be a string"),
])
def test_a_body_the_router_cannot_rank_is_a_400_naming_why(raw: bytes, message: str) -> None:
    refused = request_json(raw)
    assert isinstance(refused, Response) and refused.status_code == 400
    error = json.loads(bytes(refused.body))["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    picked = parse_body(raw)  # the picker answers Envoy with the same status and body
    assert isinstance(picked, Refusal) and (picked.status, picked.body) == (400, bytes(refused.body))


def test_a_json_object_passes_and_the_picker_reads_no_body_as_empty() -> None:
    assert request_json(b'{"model": "m", "prompt": "x"}') == {"model": "m", "prompt": "x"}
    assert request_json(b'{"prompt": "x"}') == {"prompt": "x"}
    assert parse_body(b"") == {}


@pytest.mark.parametrize("nesting", [b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_json_nested_past_the_decoders_depth_is_a_400_not_a_crash(nesting: bytes) -> None:
    # The decoder gives up with RecursionError, not ValueError: uncaught, it was a 500 with a
    # traceback logged per request, which a client could send as fast as it liked.
    refused = request_json(nesting)
    assert isinstance(refused, Response) and refused.status_code == 400
    assert "invalid JSON body" in json.loads(bytes(refused.body))["error"]["message"]
    picked = parse_body(nesting)
    assert isinstance(picked, Refusal) and picked.status == 400
