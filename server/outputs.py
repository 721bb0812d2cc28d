"""What the engine hands back: per-request outputs, plus KV cache events and stats.

For the server (``OutputKind.DELTA``) each output is a delta: the text, token ids and logprobs
its step added; ``merge_deltas`` folds several into one. Otherwise outputs are cumulative
(everything so far). Either way ``metrics`` is a snapshot taken when the output was made.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str


# One generated position: token id -> Logprob, holding the chosen token and the top-N.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[PositionLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Structured outputs: how long the request's grammar took to compile (0 when cached).
    grammar_compile_s: float | None = None
    grammar_cache_hit: bool | None = None

    def snapshot(self) -> RequestMetrics:
        """A copy that stays as it is while the request moves on (one per output: a step of 256
        sequences makes 256; ``dataclasses.replace`` cost three times as much)."""
        copied = object.__new__(RequestMetrics)
        copied.__dict__.update(self.__dict__)
        return copied


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    # With SamplingParams.prompt_logprobs: per prompt token, None for the first one.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Set when the engine refused the request before any token (its grammar failed to compile or
    # timed out): the message for the client, and why (compiler.GrammarFailure.reason: the
    # client gets a 400, or a 503 for "wait_timeout").
    error: str | None = None
    error_reason: str | None = None


def merge_deltas(deltas: list[RequestOutput]) -> RequestOutput:
    """One output equal to the given deltas of a request, in order (a reader that fell behind,
    or a caller collecting the whole answer); linear in their total size."""
    if len(deltas) == 1:
        return deltas[0]
    texts: dict[int, list[str]] = {}
    merged: dict[int, CompletionOutput] = {}
    for delta in deltas:
        for completion in delta.outputs:
            into = merged.get(completion.index)
            if into is None:
                into = merged[completion.index] = CompletionOutput(
                    completion.index, "", [], logprobs=[] if completion.logprobs is not None else None)
                texts[completion.index] = []
            texts[completion.index].append(completion.text)
            into.token_ids.extend(completion.token_ids)
            if completion.logprobs is not None:
                if into.logprobs is None:
                    into.logprobs = []
                into.logprobs.extend(completion.logprobs)
            into.finish_reason, into.stop_reason = completion.finish_reason, completion.stop_reason
    for index, completion in merged.items():
        completion.text = "".join(texts[index])
    first, last = deltas[0], deltas[-1]
    return RequestOutput(
        # Only a request's first delta carries its prompt (output_builder.delta_output).
        request_id=last.request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
        outputs=[merged[i] for i in sorted(merged)], finished=last.finished,
        num_cached_tokens=last.num_cached_tokens, metrics=last.metrics,
        prompt_logprobs=next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None),
        error=next((d.error for d in deltas if d.error is not None), None),
        error_reason=next((d.error_reason for d in deltas if d.error_reason is not None), None),
    )


# KV cache events, published by replicas so the router knows which blocks each one holds.
@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    block_size: int
    tier: int = 1  # 1: the device's KV pool; 2: the host tier (kvscale.server.core.host_tier)
    # The block's tokens and LoRA adapter: vLLM-format consumers (llm-d, Dynamo) hash the tokens
    # themselves (docs/engine.md "KV events for llm-d and Dynamo"); the Redis sink ignores them.
    token_ids: tuple[int, ...] = ()
    lora_name: str | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    tier: int = 1


@dataclass
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class EngineStats:
    """A point-in-time view for metrics, heartbeats and the autoscaler."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_active: int  # held by live requests
    kv_blocks_cached: int  # free but still holding a reusable prefix (evictable)
    block_size: int
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int  # cumulative, in tokens
    num_preemptions: int  # cumulative
    extra: dict[str, float] = field(default_factory=dict)
    kv_cache_dtype: str = "auto"  # what the cache stores (vLLM's cache_dtype label): the engine fills it in
    # LoRA adapters of the running and the waiting requests, sorted (vLLM's lora_requests_info labels)
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    # The LoRA adapters registered, and those resident in the device's slots now, sorted: the
    # heartbeat tells routers which replicas serve an adapter and where it is loaded (docs/router.md).
    lora_adapters: list[str] = field(default_factory=list)
    resident_lora_adapters: list[str] = field(default_factory=list)
    # Running requests by priority (all 0 under fcfs): the heartbeat tells routers what a more
    # urgent request displaces here (router/band_preemption.py).
    running_by_priority: dict[int, int] = field(default_factory=dict)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_active / self.kv_blocks_total if self.kv_blocks_total else 0.0
