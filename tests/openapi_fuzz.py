"""schemathesis fuzzing of the OpenAI API, shared by the server's test and the router's: requests
generated from the server's /openapi.json as the fuzzing pass generates them (bench.fuzz_openapi:
kept cheap enough for a shared CPU), and the checks every answer must pass (no 5xx; the OpenAI
error JSON on API errors)."""

from __future__ import annotations

from typing import Any

from schemathesis import GenerationMode

from bench.fuzz_openapi import API_PATHS, ERROR_KEYS, cheap, run_cases

__all__ = ["API_PATHS", "cheap", "fuzz"]


def fuzz(operation: Any, mode: GenerationMode, base_url: str, calls: dict[str, int],
         headers: dict[str, str] | None = None, max_examples: int = 8) -> None:
    """``max_examples`` generated requests for ``operation`` sent to ``base_url``; ``calls``
    counts them per operation."""
    def check(case: Any) -> None:
        response = case.call(base_url=base_url, headers=headers or {}, timeout=120)
        calls[operation.label] = calls.get(operation.label, 0) + 1
        assert response.status_code < 500, (
            f"{operation.label} {case.body!r} -> {response.status_code} {response.text}")
        if response.status_code >= 400 and operation.path.startswith(API_PATHS):
            assert set(response.json()["error"]) == ERROR_KEYS

    run_cases(operation, mode, max_examples, check)
