"""The OpenAI-compatible wire format: request and response bodies, and the OpenAI error body.

Requests are validated here as far as a schema can say (ranges, types, no NaN); rules that need
the model (context length, vocabulary) live in api_server. The field constraints also end up in
/openapi.json, which is what schemathesis generates requests from.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from kvscale.tokenization import message_text

# vLLM's range for seeds: anything a 64-bit generator seed accepts.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
MAX_LOGPROBS = 20
MAX_N = 128

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    # NaN/inf slip through JSON parsers (Python's accepts `NaN`), and would poison sampling.
    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")


class RequestBody(OpenAIModel):
    """A request body: fields neither OpenAI's API nor vLLM's extras define are kept aside
    (``model_extra``) so the server can log them once and count them, as vLLM does."""

    model_config = ConfigDict(allow_inf_nan=False, extra="allow")


# ----------------------------------------------------------------------------- structured outputs


class JsonSchemaFormat(OpenAIModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="ignore", populate_by_name=True)

    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's ``structured_outputs`` (exactly one of the constraints)."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# ----------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ----------------------------------------------------------------------------- requests


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingFields(RequestBody):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(None, min_length=1)
    # vLLM's: stream every this many tokens (at least the server's --stream-interval).
    stream_interval: int | None = Field(None, ge=1)
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # Accepted as metadata: they change nothing the model generates.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Fields OpenAI defines that this server cannot honour: refused with a 400 naming them when set
    # (refused_fields.REFUSED_FIELDS says why).
    best_of: int | None = None
    suffix: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # vLLM's beam search: types and combinations checked by serving_beam.py (a 400 naming the field).
    use_beam_search: Any = None
    length_penalty: Any = None
    # vLLM's sampling extras this engine does not implement (refused_fields.py says why).
    prompt_logprobs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None
    return_tokens_as_token_ids: Any = None
    # vLLM's: lower first under --scheduling-policy priority (request_priority.py checks it).
    priority: StrictInt | None = None
    spaces_between_special_tokens: Any = None


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)
    ]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    """One message; an assistant's ``tool_calls`` and a tool result's ``tool_call_id`` reach the
    template (kvscale.tokenization.normalize_chat_messages)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    def text(self) -> str:
        content = self.content
        return message_text([part.model_dump() for part in content] if isinstance(content, list) else content)


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, description="deprecated: use max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extras this server does not implement (refused_fields.py says why).
    echo: Any = None
    continue_final_message: Any = None
    add_generation_prompt: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None


class TokenizeRequest(OpenAIModel):
    """Either ``prompt`` (tokenized as /v1/completions does) or ``messages`` (as chat does)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]


# ----------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    # The first delta of a call carries index, id, type and function.name; later ones index and
    # function.arguments pieces, which add up to the whole call's arguments.
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvscale"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); None for a base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def error_body(message: str, err_type: str, *, param: str | None = None, code: Any = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=code)).model_dump()
