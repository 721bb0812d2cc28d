"""POST /tokenize and POST /detokenize: the ids a generate request would use, and back."""

from __future__ import annotations

from kvscale.server.entrypoints import protocol as p
from kvscale.server.entrypoints.serving import OpenAIServer, bad_request
from kvscale.server.entrypoints.serving_chat import chat_ids
from kvscale.tokenization import completion_prompt_token_ids


def tokenize(server: OpenAIServer, body: p.TokenizeRequest) -> p.TokenizeResponse:
    server.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Give exactly one of prompt and messages.", "prompt")
    if body.prompt is not None:
        ids = completion_prompt_token_ids(server.tokenizer, body.prompt)
    else:
        ids = chat_ids(server, body.messages or [], body.tools)
    return p.TokenizeResponse(count=len(ids), max_model_len=server.max_model_len, tokens=ids)


def detokenize(server: OpenAIServer, body: p.DetokenizeRequest) -> p.DetokenizeResponse:
    server.check_model(body.model)
    bad = next((t for t in body.tokens if t >= server.vocab_size), None)
    if bad is not None:
        raise bad_request(f"Token id {bad} is out of vocabulary (size {server.vocab_size}).", "tokens")
    return p.DetokenizeResponse(prompt=server.tokenizer.decode(body.tokens))
