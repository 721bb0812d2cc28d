"""The Responses API's wire format (OpenAI's ``POST /v1/responses``): the request body and the
bounds on what a client controls in it (docs/server.md "The Responses API").

Input items, tools and ``tool_choice`` arrive as plain JSON objects and are read one by one in
responses_input.py, so that an item the server cannot honour (an image, a built-in tool) gets a
400 naming it and its position, not a schema error about a union.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt, field_validator

from kvscale.responses_messages import (
    MAX_CONTENT_PARTS,
    MAX_INPUT_ITEMS,
    MAX_RESPONSE_ID_CHARS,
    MAX_TOOLS,
)
from kvscale.server.entrypoints.protocol import MAX_LOGPROBS, OpenAIModel, RequestBody

# OpenAI's own bounds on metadata: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# The one ``include`` value this server honours: the output text's logprobs.
OUTPUT_LOGPROBS = "message.output_text.logprobs"
MAX_INCLUDE = 32  # OpenAI defines eight values; more is not a request any client sends


class TextFormat(OpenAIModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` (its fields flat, as the
    Responses API spells them, not under ``json_schema`` as chat does)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class StreamOptions(OpenAIModel):
    include_obfuscation: bool | None = None


class ResponsesRequest(RequestBody):
    """``POST /v1/responses``. Fields OpenAI defines that change nothing generated (``user``,
    ``safety_identifier``, ``prompt_cache_key``, ``service_tier``) are accepted as metadata;
    those the server cannot carry out are refused when set (responses_input.REFUSED)."""

    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_INPUT_ITEMS)] | None = None
    instructions: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = Field(None, min_length=1, max_length=MAX_RESPONSE_ID_CHARS)
    metadata: dict[str, str] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    # vLLM's: carried to the chat request, checked there (request_priority.py).
    priority: StrictInt | None = None
    # OUTPUT_LOGPROBS or nothing (responses_input.check_refused); top_logprobs needs it.
    include: Annotated[list[Annotated[str, Field(max_length=128)]], Field(max_length=MAX_INCLUDE)] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Refused when set (responses_input.REFUSED says why).
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    context_management: Any = None
    background_options: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"metadata holds at most {MAX_METADATA_KEYS} pairs, got {len(value)}")
        for key, text in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters")
            if len(text) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"metadata values are at most {MAX_METADATA_VALUE_CHARS} characters")
        return value


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class MessageItem(OpenAIModel):
    """A message among the input items (``type`` may be left out, as in OpenAI's easy form); an
    earlier answer's output message passed back as input carries ``output_text`` parts."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)]


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_RESPONSE_ID_CHARS)
    name: str = Field(min_length=1, max_length=64)
    arguments: str


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_RESPONSE_ID_CHARS)
    output: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)]


class FunctionTool(OpenAIModel):
    """A function tool as the Responses API spells it (flat: no ``function`` wrapper)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
