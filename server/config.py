"""Engine settings: what model, how the KV cache is sized, and the batch limits."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# On CPU the KV cache lives in ordinary memory; without an explicit budget the engine takes this.
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3

# What --quantization takes (vLLM's spelling); server/worker/quantization.py runs it.
QUANTIZATIONS = ("int8",)

# What --kv-cache-dtype takes (vLLM's spelling; fp8 is fp8_e4m3); server/worker/kv_cache_dtype.py resolves it.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

# What --scheduling-policy takes (vLLM's spelling); server/core/priority_order.py runs "priority".
SCHEDULING_POLICIES = ("fcfs", "priority")
# A request's priority is bounded (vLLM takes any int): |priority| <= 2**31 keeps the wire and the
# scheduler's sort keys plain machine ints (docs/server.md, "Priority scheduling").
MAX_PRIORITY = 2**31

# What ``compile_priority`` takes (structured_outputs/thread_priority.py applies it): "idle" is
# SCHED_IDLE, "nice" nice 19, "normal" the process's own.
PRIORITIES = ("idle", "nice", "normal")

DEFAULT_COMPILE_TIMEOUT_S = 10.0
# Generous: a compile within its CPU-time limit is only this late when the engine has kept every
# core busy for this long; it bounds the client's wait, it is not meant to refuse schemas.
DEFAULT_COMPILE_WAIT_TIMEOUT_S = 60.0
# Compile workers starved while the engine is idle (by other processes: compile_pool.py) are
# rescued after this long: it costs their requests this much, then they compile as if not lowered.
DEFAULT_COMPILE_STARVED_AFTER_S = 1.0
DEFAULT_CACHE_SIZE = 512
DEFAULT_CACHE_BYTES = 256 * 2**20  # compiled grammars, as estimated (structured_outputs/compiler.py)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """``--structured-outputs-config`` (vLLM's flag; JSON)."""

    backend: str = "guidance"
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S  # the compile's own CPU time
    compile_wait_timeout_s: float = DEFAULT_COMPILE_WAIT_TIMEOUT_S  # wall clock, queue included
    compile_workers: int = 1
    compile_priority: str = "idle"  # thread_priority.PRIORITIES
    compile_starved_after_s: float = DEFAULT_COMPILE_STARVED_AFTER_S
    mask_threads: int = 1  # >1: the batch bitmask is filled by the library's threads
    cache_size: int = DEFAULT_CACHE_SIZE
    cache_bytes: int = DEFAULT_CACHE_BYTES
    # Append the tokens the grammar forces (keys, punctuation) without a sampling step each; the
    # next step computes their KV as one chunk (manager.py, docs/server.md). On by default: it
    # gained on the shared sample's schemas (docs/performance.md "Structured outputs", bench/structured_fast_forward.py).
    fast_forward: bool = True

    def __post_init__(self) -> None:
        if self.backend not in ("guidance", "llguidance", "auto"):
            raise ValueError(
                f"structured outputs backend {self.backend!r} is not available: kvscale enforces "
                "grammars with llguidance ('guidance'); see docs/server.md for why not xgrammar")
        if not self.compile_timeout_s > 0:
            raise ValueError("compile_timeout_s must be positive")
        # Below the CPU-time limit the wait bound would decide alone, even on an idle machine.
        if not self.compile_wait_timeout_s >= self.compile_timeout_s:
            raise ValueError(f"compile_wait_timeout_s ({self.compile_wait_timeout_s:g}) must be at least "
                             f"compile_timeout_s ({self.compile_timeout_s:g})")
        if self.compile_priority not in PRIORITIES:
            raise ValueError(f"compile_priority must be one of {', '.join(PRIORITIES)}")
        if not self.compile_starved_after_s > 0:
            raise ValueError("compile_starved_after_s must be positive")
        if self.compile_workers < 1 or self.mask_threads < 1 or self.cache_size < 0 or self.cache_bytes < 0:
            raise ValueError("compile_workers and mask_threads must be at least 1, cache_size and "
                             "cache_bytes non-negative")
        if not isinstance(self.fast_forward, bool):
            raise ValueError("fast_forward must be true or false")



# The longest draft a step verifies: its chunk then still attends as one-token rows
# (server/worker/model_runner.py, MAX_DECODE_ROWS_CHUNK), the decode kernel's own numerics.
MAX_SPECULATIVE_TOKENS = 16
# Suffix decoding's bounds (server/core/suffix_tree.py): the trie's depth, the responses it caches
# (vLLM's default, 10000, is the largest) and its nodes, whatever the responses' lengths.
MAX_SUFFIX_TREE_DEPTH = 64
MAX_SUFFIX_CACHED_REQUESTS = 10000
SUFFIX_TREE_MAX_NODES = 1 << 18
MAX_SUFFIX_SPEC_FACTOR = 64.0
_NGRAM_KEYS = {"prompt_lookup_max", "prompt_lookup_min"}
_SUFFIX_KEYS = {"suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config`` (vLLM's flag and JSON keys): drafts without a draft model, verified
    by the target model itself (server/engine/spec_step.py). ``"ngram"``: prompt lookup
    (server/core/ngram_proposer.py); ``prompt_lookup_min``/``_max``: the n-gram lengths matched,
    longest first (one given sets the other; neither: 5 each). ``"suffix"``: suffix decoding
    (server/core/suffix_proposer.py) with vLLM's ``suffix_decoding_*`` keys and defaults;
    ``num_speculative_tokens`` is then the most a step drafts (omitted: the tree depth, at most
    16). ``disable_by_batch_size``: steps with more decoding sequences than this decode normally
    (server/core/spec_decode.py)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    disable_by_batch_size: int = 4
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "suffix"):
            raise ValueError(f"speculative method {self.method!r} is not implemented: only \"ngram\" "
                             "(prompt lookup) and \"suffix\" (suffix decoding), no draft model, are")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max")
        if self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be at least 1")
        if not 2 <= self.suffix_decoding_max_tree_depth <= MAX_SUFFIX_TREE_DEPTH:
            raise ValueError(f"suffix_decoding_max_tree_depth must be in [2, {MAX_SUFFIX_TREE_DEPTH}]")
        if not 0 <= self.suffix_decoding_max_cached_requests <= MAX_SUFFIX_CACHED_REQUESTS:
            raise ValueError(f"suffix_decoding_max_cached_requests must be in [0, {MAX_SUFFIX_CACHED_REQUESTS}]")
        if not 0 < self.suffix_decoding_max_spec_factor <= MAX_SUFFIX_SPEC_FACTOR:
            raise ValueError(f"suffix_decoding_max_spec_factor must be in (0, {MAX_SUFFIX_SPEC_FACTOR:g}]")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1]")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """The flag's JSON; unknown keys, keys of the other method, a draft model, a missing method
        or (for n-gram) token count are refused."""
        from kvscale.server.json_object import parse_json_object

        raw = parse_json_object(text)
        method = raw.get("method")
        own_keys = _SUFFIX_KEYS if method == "suffix" else _NGRAM_KEYS
        unknown = sorted(set(raw) - own_keys - {"method", "num_speculative_tokens", "disable_by_batch_size"})
        if unknown:
            raise ValueError(f"--speculative-config keys not supported with method {method!r}: {', '.join(unknown)} "
                             "(only n-gram and suffix speculation, no draft model, are implemented)")
        if method is None or (method != "suffix" and raw.get("num_speculative_tokens") is None):
            raise ValueError('--speculative-config needs "method" and (but for "suffix") "num_speculative_tokens"')
        values = dict(raw)
        if method == "suffix":
            depth = raw.get("suffix_decoding_max_tree_depth", 24)
            if raw.get("num_speculative_tokens") is None and isinstance(depth, int):
                values["num_speculative_tokens"] = min(depth, MAX_SPECULATIVE_TOKENS)
        else:
            low, high = values.pop("prompt_lookup_min", None), values.pop("prompt_lookup_max", None)
            if low is None and high is None:
                low = high = 5
            values |= {"prompt_lookup_min": high if low is None else low,
                       "prompt_lookup_max": low if high is None else high}
        reals = {"suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"}
        for key, value in values.items():
            real = key in reals and isinstance(value, float)
            if key != "method" and (isinstance(value, bool) or not (isinstance(value, int) or real)):
                raise ValueError(f"--speculative-config's {key} must be a number" if key in reals
                                 else f"--speculative-config's {key} must be an integer")
        return cls(**values)


def lora_refusal(config: EngineConfig) -> str | None:
    """Why these LoRA settings cannot run (docs/server.md, "LoRA adapters"); None where they can."""
    if not config.enable_lora:
        return "--lora-modules needs --enable-lora" if config.lora_modules else None
    if config.max_loras < 1 or config.max_lora_rank < 1:
        return "--max-loras and --max-lora-rank must be at least 1"
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        return f"--max-cpu-loras ({config.max_cpu_loras}) must be at least --max-loras ({config.max_loras})"
    if config.tensor_parallel_size > 1:
        return "--enable-lora cannot be combined with --tensor-parallel-size > 1 yet"
    if config.quantization is not None:
        return "--enable-lora cannot be combined with --quantization yet"
    return None


# Tensor-parallel ranks on several nodes (vLLM's --nnodes, --node-rank, --master-addr,
# --master-port; server/worker/tp_nodes.py): the leader's torch.distributed rendezvous is on the
# master port and its step messages on the next one, authenticated by this key (docs/engine.md).
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
TP_AUTHKEY_ENV = "KVSCALE_TP_AUTHKEY"
MIN_TP_AUTHKEY_BYTES = 16


def multi_node_refusal(size: int, nnodes: int, node_rank: int, master_addr: str, master_port: int, *,
                       headless: bool, authkey: str | None) -> str | None:
    """Why these multi-node settings cannot run (docs/engine.md, "Ranks on several nodes"); None
    where they can. ``authkey`` is $KVSCALE_TP_AUTHKEY's value (None: unset)."""
    if nnodes < 1:
        return f"--nnodes must be at least 1, got {nnodes}"
    if not 0 <= node_rank < nnodes:
        return f"--node-rank must be in 0..{nnodes - 1} for --nnodes {nnodes}, got {node_rank}"
    if size % nnodes:
        return (f"--tensor-parallel-size {size} is not a multiple of --nnodes {nnodes} (it counts every "
                "node's ranks; each node runs the same number)")
    if headless and nnodes == 1:
        return "--headless runs one node's ranks for a leader elsewhere: it needs --nnodes above 1"
    if headless and node_rank == 0:
        return "node 0 is the leader (it serves HTTP and runs rank 0): --headless needs --node-rank 1 or above"
    if not headless and node_rank:
        return f"--node-rank {node_rank} runs only its ranks, for node 0's server: add --headless"
    if nnodes == 1:
        return None
    if not master_addr:
        return "--master-addr must name the leader (node 0)"
    if not 1 <= master_port < 65535:
        return f"--master-port must be in 1..65534 (the step messages use the next port), got {master_port}"
    if authkey is None or len(authkey.encode()) < MIN_TP_AUTHKEY_BYTES:
        return (f"--nnodes above 1 needs ${TP_AUTHKEY_ENV}, the same secret of at least "
                f"{MIN_TP_AUTHKEY_BYTES} bytes on every node ({'unset' if authkey is None else 'too short'}): "
                "the ranks' step messages are pickled, and a listener open to anyone would run what they send")
    return None


@dataclass
class EngineConfig:
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    served_model_name: str | None = None
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Many sequences per step amortise the weight reads; 64 keeps a 2-core CPU busy
    # without making a single step too long for streaming latency.
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None  # CPU budget for the KV cache
    # GiB of host memory for a second KV tier (vLLM's --kv-offloading-size); 0: no second tier.
    kv_offloading_size: float = 0.0
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    quantization: str | None = None  # None | "int8" (weights quantized at load: server/worker/quantization.py)
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES: "auto" (the model's dtype) or an FP8 format
    seed: int = 0
    # On a GPU, decode steps replay CUDA graphs (server/worker/decode_graphs.py) unless this is set
    # (vLLM's --enforce-eager); CPU steps are always eager.
    enforce_eager: bool = False
    # Queue the next step before this one's tokens are read (server/core/async_scheduling.py; vLLM's
    # --async-scheduling). None: on where it overlaps anything, i.e. on a GPU.
    async_scheduling: bool | None = None
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    # Ranks the model's heads, MLP and vocabulary are split over (vLLM's --tensor-parallel-size):
    # 1 runs in the engine core alone; N > 1 adds N - 1 rank processes (server/worker/tp_group.py).
    tensor_parallel_size: int = 1
    # Nodes those ranks span, this one's index (0: the leader, the only one an engine runs on), and
    # where the leader is reached (multi_node_refusal above; server/worker/tp_nodes.py).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    # LoRA adapters (vLLM's --enable-lora, --lora-modules, --max-loras, --max-lora-rank,
    # --max-cpu-loras; server/worker/lora_manager.py): name -> PEFT directory, the adapters resident
    # at once, their largest rank, the adapters kept in host memory (None: --max-loras).
    enable_lora: bool = False
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's --scheduling-policy: "fcfs", or "priority" (each request's ``priority``, lower first;
    # server/core/priority_order.py).
    scheduling_policy: str = "fcfs"
    # vLLM's --speculative-config; None: every step decodes one token per sequence.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        why = lora_refusal(self)
        if why is not None:
            raise ValueError(why)
        if self.speculative_config is not None and (self.tensor_parallel_size > 1 or self.async_scheduling):
            raise ValueError("--speculative-config cannot be combined with --tensor-parallel-size > 1 or "
                             "--async-scheduling yet (its steps run synchronously)")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        why = multi_node_refusal(self.tensor_parallel_size, self.nnodes, self.node_rank, self.master_addr,
                                 self.master_port, headless=False, authkey=os.environ.get(TP_AUTHKEY_ENV))
        if why is not None:
            raise ValueError(why)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float"):
            raise ValueError(
                f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization {self.quantization!r} is not supported (supported: {', '.join(QUANTIZATIONS)})"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported (supported: {', '.join(KV_CACHE_DTYPES)})"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be at least 1")
        if not self.kv_offloading_size >= 0:
            raise ValueError(f"kv_offloading_size must be at least 0 GiB, got {self.kv_offloading_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")
