"""A request's prompt as the replicas' prefix caches see it: token ids, then full-block hashes.

The router tokenizes with the server's own functions (``kvscale.tokenization``) and hashes with
the engine's (``kvscale.block_hash``), so a hash computed here is the hash a replica reports.
Chat prompts go through a per-model ``ChatTokenCache``: a follow-up turn tokenizes and hashes
only what follows the cached history. A prompt this router cannot tokenize gets no hashes (the
request is still routed, by load); the replica then answers with the proper error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, NamedTuple

from kvscale.block_hash import hash_prompt_blocks
from kvscale.router.chat_tokens import DEFAULT_MAX_TOKENS, ChatTokenCache
from kvscale.tokenization import completion_prompt_token_ids

log = logging.getLogger("kvscale.router")
# Requests at least this large (bytes; about 4k tokens of text) are hashed off the event loop.
OFF_LOOP_BYTES = 16_384


class PromptBlocks(NamedTuple):
    hashes: list[int]  # of the prompt's full blocks; empty when it could not be tokenized here
    prompt_tokens: int
    block_size: int


class PrefixHasher:
    """Tokenizers and chat caches per served model name, and each model's block size.

    ``block_sizes`` is learned from the replicas' heartbeats; until a model's first heartbeat its
    prompts are hashed with ``default_block_size``. ``on_fallback`` is told why a prompt got no
    hashes ("no_tokenizer" or "untokenizable").
    """

    def __init__(
        self,
        models: list[str | None],
        default_block_size: int = 16,
        chat_cache_tokens: int = DEFAULT_MAX_TOKENS,
        on_fallback: Callable[[str], None] = lambda reason: None,
        served_names: list[str] | None = None,
        tool_format: str = "hermes",
    ) -> None:
        if served_names and len(models) != 1:
            raise ValueError("served model names name one model; give one model with them")
        self.models = models
        self.served_names = served_names or []
        self.default_block_size = default_block_size
        self.chat_cache_tokens = chat_cache_tokens
        self.tool_format = tool_format
        self.tokenizers: dict[str, Any] = {}
        self.chat_caches: dict[str, ChatTokenCache] = {}
        self.block_sizes: dict[str, int] = {}
        self.load_errors: dict[str, str] = {}  # served name -> why its tokenizer did not load
        self._on_fallback = on_fallback
        self._executor: ThreadPoolExecutor | None = None

    def names_of(self, model: str | None) -> list[str]:
        """The names the servers answer to for ``model``: what requests carry as "model"."""
        from kvscale.model_files import served_model_name

        return self.served_names or [served_model_name(model)]

    def load_tokenizers(self) -> None:
        """Blocking (file reads, and the bundled model's extraction on first use): call it in a
        thread from the event loop. A tokenizer that cannot be loaded leaves its model routed by
        load alone, and says so (the error log line, ``load_errors``); it does not stop the
        router, which still serves every request."""
        from kvscale.model_files import load_tokenizer, resolve_tokenizer_path

        for model in self.models:
            names = self.names_of(model)
            try:
                # The tokenizer alone: the bundled model's full conversion needs torch.
                tokenizer = load_tokenizer(resolve_tokenizer_path(model))
            except Exception as exc:  # any failure to load means the same: no prefix routing
                error = f"{type(exc).__name__}: {exc}"
                for name in names:
                    self.load_errors[name] = error
                log.error("no tokenizer for %s from %s (%s): its requests are routed by load "
                          "alone, without prefix-cache affinity", ", ".join(names),
                          model or "the bundled model", error)
                continue
            for name in names:
                self.tokenizers[name] = tokenizer
                self.chat_caches[name] = ChatTokenCache(tokenizer, self.chat_cache_tokens, self.tool_format)
                self.load_errors.pop(name, None)
            log.info("tokenizer for %s loaded from %s", ", ".join(names), model or "the bundled model")

    def block_size(self, name: str) -> int:
        """The block size of the model served as ``name``: learned from heartbeats, which name a
        model by its first served name only, so any of the model's names finds it (the names whose
        tokenizer is the same one)."""
        if name in self.block_sizes:
            return self.block_sizes[name]
        tokenizer = self.tokenizers.get(name)
        for other, size in self.block_sizes.items():
            if tokenizer is not None and self.tokenizers.get(other) is tokenizer:
                return size
        return self.default_block_size

    def tokenizer_status(self) -> dict[str, str | None]:
        """Each served name the router was told of: None when its tokenizer is loaded, else why not."""
        status: dict[str, str | None] = {name: None for name in self.tokenizers}
        status.update(self.load_errors)
        return status

    async def prompt_block_hashes_off_loop(
        self, endpoint: str, body: dict[str, Any], model: str | None, body_bytes: int, lora_name: str | None = None
    ) -> PromptBlocks:
        """``prompt_block_hashes``, off the event loop for a long prompt: tokenizing, rendering a
        chat template and hashing 100k tokens takes about 0.7 s here, and on the loop it would stall
        every stream the router proxies meanwhile. A short prompt (``body_bytes``, the request's
        size, under OFF_LOOP_BYTES) is hashed in place: handing it to a thread costs more (the GIL
        changes hands every 5 ms on a busy loop) than hashing it. The thread hashes chat prompts
        without the chat token cache, which only the loop touches."""
        if body_bytes < OFF_LOOP_BYTES:
            return self.prompt_block_hashes(endpoint, body, model, lora_name=lora_name)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvscale-router-hash")
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, partial(self.prompt_block_hashes, endpoint, body, model, chat_cache=False, lora_name=lora_name))

    def prompt_block_hashes(
        self, endpoint: str, body: dict[str, Any], model: str | None, chat_cache: bool = True,
        lora_name: str | None = None,
    ) -> PromptBlocks:
        """The prompt of a "chat" or "completions" request ``body`` (its parsed JSON); ``chat_cache``
        False hashes a chat prompt whole, leaving the model's chat token cache untouched.
        ``lora_name``: the LoRA adapter the request names, ``model`` then its base: the engine keys
        an adapter's blocks by its name (``kvscale.block_hash.first_block_keys``), so they are too."""
        name = model if model else next(iter(self.tokenizers), "")
        tokenizer = self.tokenizers.get(name)
        # By the name whose tokenizer is used: a request without "model" goes to that model.
        block_size = self.block_size(name)
        if tokenizer is None:
            self._on_fallback("no_tokenizer")
            return PromptBlocks([], 0, block_size)
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        try:
            if endpoint == "chat":
                # A follow-up turn tokenizes and hashes only what follows the cached history.
                cache = self.chat_caches.get(name) if chat_cache else ChatTokenCache(tokenizer, 0, self.tool_format)
                if cache is None:  # a tokenizer set without load_tokenizers
                    cache = ChatTokenCache(tokenizer, self.chat_cache_tokens, self.tool_format)
                    self.chat_caches[name] = cache
                token_ids, hashes = cache.prompt(body["messages"], block_size, salt, body.get("tools"), lora_name)
                return PromptBlocks(hashes, len(token_ids), block_size)
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch: route by its first prompt
            token_ids = completion_prompt_token_ids(tokenizer, prompt)
        except Exception:
            # A malformed prompt: the replica will answer with the proper error.
            self._on_fallback("untokenizable")
            return PromptBlocks([], 0, block_size)
        hashes = hash_prompt_blocks(token_ids, block_size, cache_salt=salt, lora_name=lora_name)
        return PromptBlocks(hashes, len(token_ids), block_size)
