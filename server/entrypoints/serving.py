"""What every OpenAI endpoint shares before the engine answers: the server's state and checks,
the error type, request fields to SamplingParams, and opening engine streams.

Each endpoint (serving_completions.py, serving_chat.py, serving_tokenize.py) prepares its request
with these; serving_streams.py reads the answers.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from kvscale import request_limits
from kvscale.server.engine.engine_front import EngineDeadError, EngineFront, RequestStream
from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints import request_json
from kvscale.server.entrypoints.admission import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    InvalidRequest,
    check_prompt,
)
from kvscale.server.entrypoints.lora_modules import LoRAModulePath
from kvscale.server.entrypoints.tenant_header import REQUEST_TENANT
from kvscale.server.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

# Probes and scrapers never carry the API key. The API's description (/docs, /openapi.json)
# is behind it like the API itself (docs/server.md "Errors", 401).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
RETRY_AFTER_S = 1
# Unknown request field names remembered, so each is logged once: a fixed number, oldest
# forgotten first, since a client may send a new name with every request.
UNKNOWN_FIELDS_KEPT = 256
# At most one "ignoring the field" line per this many seconds, however many names arrive.
UNKNOWN_FIELDS_LOG_EVERY_S = 10.0

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": p.ErrorResponse, "description": description}
    for status, description in (
        (400, "invalid request"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (503, "queue full, engine stopped, or draining for shutdown"),
        (504, "a non-streamed answer not ready within --request-timeout"),
    )
}


class APIError(Exception):
    def __init__(self, status: int, message: str, err_type: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = p.error_body(self.message, self.err_type, param=self.param, code=self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param=param)


def _schema_object(schema: Any, param: str) -> str:
    """A schema's one serialization (compact, key order kept: the order of ``properties`` is the
    order the grammar generates them in), the compile cache's key."""
    if isinstance(schema, str):
        try:
            schema = request_json.loads(schema)
        except ValueError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param) from exc
    if not isinstance(schema, dict | bool):
        raise bad_request(f"{param} must be a JSON schema (an object)", param)
    return request_json.dumps_compact(schema)


def structured_outputs_from(server: OpenAIServer, body: p.SamplingFields
                            ) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from (for error messages), if any; a
    constraint that cannot even be read is a 400 counted as an ``invalid`` refusal."""
    try:
        return _structured_outputs_from(body)
    except APIError:
        server.count_refusal("invalid")
        raise


def _structured_outputs_from(body: p.SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    fmt = body.response_format
    so = body.structured_outputs
    constrained_format = fmt is not None and fmt.type != "text"
    if constrained_format and so is not None:
        raise bad_request("Set either response_format or structured_outputs, not both.", "structured_outputs")
    if constrained_format:
        assert fmt is not None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema.",
                              "response_format.json_schema")
        return StructuredOutputsParams(json=_schema_object(fmt.json_schema.json_schema,
                                                           "response_format.json_schema.schema"),
                                       disable_additional_properties=bool(fmt.json_schema.strict)), "response_format"
    if so is None:
        return None, None
    try:
        if so.json_schema is not None:
            return StructuredOutputsParams(json=_schema_object(so.json_schema, "structured_outputs.json")), \
                "structured_outputs"
        return StructuredOutputsParams(regex=so.regex, choice=so.choice, grammar=so.grammar,
                                       json_object=bool(so.json_object)), "structured_outputs"
    except ValueError as exc:
        raise bad_request(str(exc), "structured_outputs") from exc


def logit_bias_from(body: p.SamplingFields, vocab_size: int) -> dict[int, float] | None:
    if not body.logit_bias:
        return None
    bias: dict[int, float] = {}
    for key, value in body.logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}.", "logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"logit_bias token id {token_id} is outside the vocabulary (0..{vocab_size - 1}).",
                              "logit_bias")
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value}.", "logit_bias")
        bias[token_id] = value
    return bias


def sampling_params_from(
    request: p.SamplingFields, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None, logit_bias: dict[int, float] | None = None,
) -> SamplingParams:
    """SamplingParams for a completion or chat request (OpenAI's defaults where unset)."""

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    stop = request.stop
    return SamplingParams(
        n=request.n,
        temperature=pick(request.temperature, 1.0),
        top_p=pick(request.top_p, 1.0),
        top_k=pick(request.top_k, -1),
        min_p=pick(request.min_p, 0.0),
        seed=request.seed,
        repetition_penalty=pick(request.repetition_penalty, 1.0),
        presence_penalty=pick(request.presence_penalty, 0.0),
        frequency_penalty=pick(request.frequency_penalty, 0.0),
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stop_token_ids=list(request.stop_token_ids or []),
        include_stop_str_in_output=request.include_stop_str_in_output,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=request.skip_special_tokens,
        logit_bias=logit_bias,
        structured_outputs=structured_outputs,
    )


def check_stream_options(body: p.SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options can only be set when stream is true.", "stream_options")


@dataclass
class Prepared:
    """A validated request, ready for the engine: one prompt per engine request."""

    request_id: str
    prompts: list[list[int]]
    echo_texts: list[str]
    params: list[SamplingParams]
    cache_salt: str | None
    # The field a grammar came from (response_format, structured_outputs, tools): an engine
    # refusal of the grammar becomes a 400 naming it.
    constraint_param: str | None = None
    tools: Any = None  # chat's serving_tools.ToolPlan
    stream_interval: int | None = None  # the request's own (vLLM's extra field); None: the server's
    lora_name: str = ""  # the LoRA adapter the request's `model` named; "": the base model
    priority: int = 0  # under --scheduling-policy priority, lower first (request_priority.py)


class OpenAIServer:
    """The state every endpoint reads, and the checks and engine calls they share."""

    def __init__(
        self,
        engine: EngineFront,
        *,
        tokenizer: Any,
        served_model_names: Sequence[str],
        max_model_len: int,
        api_key: str | None = None,
        max_queue_len: int | None = request_limits.DEFAULT_MAX_QUEUE_LEN,
        max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
        field_limits: request_limits.FieldLimits | None = None,
        model_root: str | None = None,
        version: str = "0",
        vocab_size: int | None = None,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
        stream_interval: int = 1, lora_modules: Sequence[LoRAModulePath] = (),
        scheduling_policy: str = "fcfs",
        request_timeout_s: float | None = None,
    ) -> None:
        self.engine = engine
        # --request-timeout: a non-streamed answer not ready by then is a 504 and its sequences
        # are aborted (docs/server.md "Request limits"); None: no deadline.
        self.request_timeout_s = request_timeout_s
        self.lora_modules = {m.name: m for m in lora_modules}  # docs/server.md, "LoRA adapters"
        self.tokenizer = tokenizer
        self.served_model_names = list(served_model_names)
        self.model_name = self.served_model_names[0]
        self.max_model_len = max_model_len
        self.api_key_digest = hashlib.sha256(api_key.encode()).digest() if api_key else None
        self.max_queue_len = max_queue_len
        self.max_prompts_per_request = max_prompts_per_request
        self.field_limits = field_limits or request_limits.FieldLimits()
        self.model_root = model_root
        self.version = version
        # Ids the model embeds and the tokenizer decodes (the engine asserts the model's bound).
        self.vocab_size = vocab_size if vocab_size is not None else len(tokenizer)
        self.tool_call_parser = tool_call_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.stream_interval = stream_interval  # --stream-interval: a request may ask for more, not less
        self.scheduling_policy = scheduling_policy  # --scheduling-policy: whether `priority` is honoured
        # Request fields neither API defines: logged once each (of the last UNKNOWN_FIELDS_KEPT
        # names, at most once per UNKNOWN_FIELDS_LOG_EVERY_S), counted per request (metrics).
        self.unknown_fields_seen: OrderedDict[str, None] = OrderedDict()
        self._unknown_logged_at = float("-inf")
        self.metrics: Any = None  # ServerMetrics, set by the app (counts refusals, kinds, fields)

    def note_unknown_fields(self, body: p.RequestBody, endpoint: str) -> None:
        for name in body.model_extra or {}:
            if name in self.unknown_fields_seen:
                self.unknown_fields_seen.move_to_end(name)
            else:
                self.unknown_fields_seen[name] = None
                if len(self.unknown_fields_seen) > UNKNOWN_FIELDS_KEPT:
                    self.unknown_fields_seen.popitem(last=False)
                now = time.monotonic()
                if now - self._unknown_logged_at >= UNKNOWN_FIELDS_LOG_EVERY_S:
                    self._unknown_logged_at = now
                    logger.warning("%s: ignoring the request field %r, which neither OpenAI's API nor "
                                   "vLLM's extras define (logged once per name, at most every %g s)",
                                   endpoint, name[:100], UNKNOWN_FIELDS_LOG_EVERY_S)
            if self.metrics is not None:
                self.metrics.count_unknown_field(endpoint)

    def count_structured(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.count_structured(kind)

    def count_tool_parse_failure(self) -> None:
        if self.metrics is not None:
            self.metrics.tool_parse_failures.inc()

    def count_refusal(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.count_refusal(reason)

    # -- checks shared by every generate endpoint

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names and model not in self.lora_modules:
            raise APIError(404, f"The model `{model}` does not exist.", "invalid_request_error",
                           param="model", code="model_not_found")

    def check_capacity(self, sequences: int = 1) -> None:
        """Room in the queue for ``sequences`` more (a request's prompts times its ``n``)."""
        if not self.engine.is_alive:
            raise APIError(503, "The engine is not running.", "server_error", code="engine_dead")
        limit = self.max_queue_len
        if limit is None:
            return
        if limit and sequences > limit:
            # Never fits, however long the client waits: a request error, not a busy server.
            raise bad_request(
                f"This request would queue {sequences} sequences (its prompts times n), more "
                f"than this server ever queues (--max-queue-len {limit}). Send fewer prompts "
                "per request or a smaller n.", "prompt")
        if self.engine.num_waiting + sequences > limit:
            raise APIError(
                503, f"The server is busy: {self.engine.num_waiting} sequences are waiting "
                f"(--max-queue-len {limit}). Retry later.", "server_error",
                code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    def check_field_limits(self, body: p.SamplingFields, prompts: int, tools: int = 0) -> None:
        """The request-wide fields' counts (docs/server.md "Request limits"), before any of them
        is parsed or copied."""
        stop = body.stop
        try:
            request_limits.check_sequences(self.field_limits, prompts, body.n)
            request_limits.check_sampling_fields(
                self.field_limits, stop=[stop] if isinstance(stop, str) else list(stop or []),
                stop_token_ids=len(body.stop_token_ids or ()), logit_bias=len(body.logit_bias or {}),
                tools=tools)
        except request_limits.LimitExceeded as exc:
            raise bad_request(exc.message, exc.param) from exc

    def check_constraint_size(self, spec: StructuredOutputsParams | None, param: str | None) -> None:
        if spec is None:
            return
        try:
            request_limits.check_structured_bytes(self.field_limits, spec.text_bytes(), param or "")
        except request_limits.LimitExceeded as exc:
            self.count_refusal("invalid")
            raise bad_request(exc.message, param) from exc

    def check_prompt_count(self, count: int) -> None:
        if count > self.max_prompts_per_request:
            raise bad_request(
                f"This request has {count} prompts; this server takes at most "
                f"{self.max_prompts_per_request} per request (--max-prompts-per-request).", "prompt")

    def check_prompt(self, ids: list[int], param: str = "prompt") -> None:
        try:
            check_prompt(ids, self.vocab_size, param)
        except InvalidRequest as exc:
            raise bad_request(exc.message, exc.param) from exc

    def is_authorized(self, path: str, method: str, authorization: bytes) -> bool:
        if self.api_key_digest is None or path in OPEN_PATHS or method == "OPTIONS":
            return True
        scheme, _, token = authorization.partition(b" ")
        # Compare digests of the bytes: equal length whatever was sent, constant time, so the
        # timing tells neither the key's length nor its prefix.
        given = hashlib.sha256(token.strip()).digest()
        matches = hmac.compare_digest(given, self.api_key_digest)
        return matches and scheme.lower() == b"bearer"

    # -- running requests

    async def open_streams(self, prepared: Prepared) -> list[RequestStream]:
        """Hand every prompt to the engine in one go (they start in the same step)."""
        self.check_capacity(sum(params.n for params in prepared.params))
        if prepared.lora_name and prepared.lora_name not in self.lora_modules:
            self.check_model(prepared.lora_name)  # unloaded while the request was read: its 404
        many = len(prepared.prompts) > 1
        requests = [
            (f"{prepared.request_id}-{index}" if many else prepared.request_id, ids, params, prepared.cache_salt)
            for index, (ids, params) in enumerate(zip(prepared.prompts, prepared.params, strict=True))
        ]
        try:
            streams = await self.engine.add_requests(
                requests, stream_interval=max(self.stream_interval, prepared.stream_interval or 1),
                tenant=REQUEST_TENANT.get(), lora_name=prepared.lora_name, priority=prepared.priority)
            if self.metrics is not None:
                self.metrics.count_lora_request(prepared.lora_name)
            return streams
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "server_error", code="engine_dead") from exc
        except (ValueError, TypeError, OverflowError) as exc:
            raise bad_request(str(exc)) from exc

    def release(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            self.engine.release(stream)

    def decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
