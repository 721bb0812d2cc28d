"""A JSON object given as a flag's value or a config file, parsed for the code that reads its fields.
Each caller names the flag or file in front of the message."""

from __future__ import annotations

import json
from typing import Any


def parse_json_object(text: str) -> dict[str, Any]:
    """``text`` as a JSON object; ValueError saying what it is instead."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value
