"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API
carried out by the chat endpoint (docs/server.md "The Responses API").

A request becomes a chat request (responses_input.py) after the stored conversation its
``previous_response_id`` names; chat's own preparation, engine streams, tool calling and
structured outputs answer it; the answer goes back as output items (responses_output.py) or as
the Responses events (responses_stream.py). With ``store`` (the default) the response and its
whole conversation are kept in the app's ``ResponseStore`` (responses_store.py).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvscale.responses_messages import MAX_RESPONSE_ID_CHARS
from kvscale.server.entrypoints.protocol_responses import ResponsesRequest
from kvscale.server.entrypoints.responses_input import chat_request, check_refused, not_found
from kvscale.server.entrypoints.responses_output import (
    ResponseHead,
    assistant_turn,
    output_items,
    part_logprobs,
    responses_usage,
)
from kvscale.server.entrypoints.responses_store import (
    ResponseStore,
    StoredResponse,
    StoreUnavailable,
)
from kvscale.server.entrypoints.responses_stream import ResponseEvents, response_events
from kvscale.server.entrypoints.serving import RETRY_AFTER_S, APIError, OpenAIServer, bad_request
from kvscale.server.entrypoints.serving_chat import (
    ChatFormatter,
    create_chat_completion,
    prepare_chat,
)
from kvscale.server.entrypoints.serving_streams import first_outputs_while_connected

logger = logging.getLogger(__name__)

ENDPOINT = "/v1/responses"


# Chat's names for the fields an error may name, and what the Responses API calls them.
CHAT_PARAMS = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
               ("max_tokens", "max_output_tokens"), ("response_format.json_schema.schema", "text.format.schema"),
               ("response_format", "text.format"))


def _responses_param(param: str | None) -> str | None:
    for chat_name, name in CHAT_PARAMS:
        if param is not None and (param == chat_name or param.startswith(chat_name + ".")):
            return name + param[len(chat_name):]
    return param


async def create_response(server: OpenAIServer, store: ResponseStore, body: ResponsesRequest,
                          request: Request) -> Any:
    """The response, or an ``APIError`` naming the request's field as the Responses API calls it."""
    try:
        return await _create_response(server, store, body, request)
    except APIError as exc:
        exc.param = _responses_param(exc.param)
        raise
    except StoreUnavailable as exc:
        raise unavailable(exc) from exc


def unavailable(exc: StoreUnavailable) -> APIError:
    return APIError(503, str(exc), "server_error", code="response_store_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


async def _create_response(server: OpenAIServer, store: ResponseStore, body: ResponsesRequest,
                           request: Request) -> Any:
    server.check_model(body.model)
    server.note_unknown_fields(body, ENDPOINT)
    check_refused(body)  # before the store is asked anything
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = await store.get(body.previous_response_id)
        if previous is None:  # OpenAI answers 400 here: the request, not the URL, names it
            raise not_found(body.previous_response_id, "previous_response_id", status=400)
        history = previous.conversation
    chat, conversation = chat_request(body, history, server.field_limits)
    head = ResponseHead(body, body.model or server.model_name)

    async def keep(response: dict[str, Any]) -> None:
        if not body.store:
            return
        record = StoredResponse(response, [*conversation, assistant_turn(response["output"])])
        try:  # the answer stands either way: it is only not kept
            if not await store.put(head.id, record):
                logger.warning("response %s is larger than the whole response store; not stored", head.id)
        except StoreUnavailable:
            logger.warning("response %s not stored: the response store did not answer", head.id)

    if body.stream:
        prepared = prepare_chat(server, chat)
        streams = await server.open_streams(prepared)
        # The 200 waits for the first token: a constrained request may be refused before it, and a
        # gateway retries a request its replica dropped only while no response has started
        # (docs/gateway.md, "When a replica dies").
        first = await first_outputs_while_connected(request, server, streams, prepared)
        formatter = ChatFormatter(server, chat, prepared)
        return StreamingResponse(response_events(server, streams, request, formatter, ResponseEvents(head),
                                                 first, keep), media_type="text/event-stream")
    answer = await create_chat_completion(server, chat, request)
    choice = answer.choices[0]
    incomplete = choice.finish_reason == "length"
    logprobs = part_logprobs(choice.logprobs.model_dump() if choice.logprobs is not None else None)
    items = output_items(choice.message.content, [call.model_dump() for call in choice.message.tool_calls],
                         incomplete, logprobs)
    usage = responses_usage(answer.usage.model_dump() if answer.usage is not None else {})
    response = head.body_of("incomplete" if incomplete else "completed", items, usage,
                            "max_output_tokens" if incomplete else None)
    await keep(response)
    return JSONResponse(response)


def _checked_id(response_id: str) -> str:
    if len(response_id) > MAX_RESPONSE_ID_CHARS:
        raise bad_request(f"A response id is at most {MAX_RESPONSE_ID_CHARS} characters.", "response_id")
    return response_id


async def retrieve_response(store: ResponseStore, response_id: str, request: Request) -> JSONResponse:
    if request.query_params.get("stream") in ("true", "1"):
        raise bad_request("stream cannot be honoured: a stored response is returned whole.", "stream")
    if request.query_params.getlist("include") or request.query_params.getlist("include[]"):
        raise bad_request("include cannot be honoured: the server stores none of the extra output data.",
                          "include")
    try:
        record = await store.get(_checked_id(response_id))
    except StoreUnavailable as exc:
        raise unavailable(exc) from exc
    if record is None:
        raise not_found(response_id)
    return JSONResponse(record.response)


async def delete_response(store: ResponseStore, response_id: str) -> JSONResponse:
    try:
        deleted = await store.delete(_checked_id(response_id))
    except StoreUnavailable as exc:
        raise unavailable(exc) from exc
    if not deleted:
        raise not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
