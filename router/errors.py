"""The error body the router answers with itself: OpenAI's shape, so clients parse it as theirs."""

from __future__ import annotations

from starlette.responses import JSONResponse


def openai_error(status: int, message: str, err_type: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": err_type, "param": None, "code": code}},
        status_code=status,
    )
