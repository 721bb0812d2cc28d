"""schemathesis fuzzing of the OpenAI API, shared by the server's test and the router's: requests
generated from the server's /openapi.json, kept cheap enough for a shared CPU, and the checks
every answer must pass (no 5xx; the OpenAI error JSON on API errors)."""

from __future__ import annotations

from typing import Any

import hypothesis
from schemathesis import GenerationMode

# Paths whose errors carry the OpenAI error JSON (others, like a router's unknown path, need not).
API_PATHS = ("/v1/", "/tokenize", "/detokenize")


def cheap(case: Any) -> None:
    """Keep generation cheap: validation and routing are under test, not generation speed."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > 4:
            body[key] = 4
    if ("prompt" in body or "messages" in body) and body.get("max_tokens") is None and body.get(
            "max_completion_tokens") is None:
        body["max_tokens"] = 4  # unset means "up to the context length": far too slow here
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 3:
        body["prompt"] = body["prompt"][:3]


def fuzz(operation: Any, mode: GenerationMode, base_url: str, calls: dict[str, int],
         headers: dict[str, str] | None = None, max_examples: int = 8) -> None:
    """``max_examples`` generated requests for ``operation`` sent to ``base_url``; ``calls``
    counts them per operation."""
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis.settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    def check(case: Any) -> None:
        cheap(case)
        response = case.call(base_url=base_url, headers=headers or {}, timeout=120)
        calls[operation.label] = calls.get(operation.label, 0) + 1
        assert response.status_code < 500, (
            f"{operation.label} {case.body!r} -> {response.status_code} {response.text}")
        if response.status_code >= 400 and operation.path.startswith(API_PATHS):
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    check()
