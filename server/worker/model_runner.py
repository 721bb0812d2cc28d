"""One forward pass per step over a flattened, unpadded batch of tokens from many sequences.

The runner owns the KV cache tensors and turns the scheduler's decisions into the tensors the
model needs: token ids, positions, the KV slot of every new token, block tables, context
lengths and where each sequence's tokens start. Attention runs on the ``kvscale.kernels``
backend for its device (C and PyTorch on CPU, Triton on GPU), picked once here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvscale import kernels
from kvscale.server.core.async_scheduling import InFlightStep
from kvscale.server.core.block_pool import TierCopies
from kvscale.server.core.block_table_rows import BlockTableRows
from kvscale.server.core.kv_offload import HostKVCache
from kvscale.server.core.scheduler import ScheduledSeq
from kvscale.server.core.sequence import PLACEHOLDER_TOKEN
from kvscale.server.core.zeroed_memory import lazily_zeroed
from kvscale.server.worker.attention_metadata import AttentionMetadata, DecodePrefillSplit
from kvscale.server.worker.decode_graphs import (
    Capture,
    DecodeGraphs,
    cuda_graph_capture,
    why_not_captured,
)
from kvscale.server.worker.glibc_malloc import keep_freed_memory_for_reuse
from kvscale.server.worker.kv_groups import KVGroups, new_group_caches, window_metadata
from kvscale.server.worker.model_llama import DecoderForCausalLM
from kvscale.server.worker.sampler import Sampler
from kvscale.server.worker.start_up_passes import StepProfile, profile_step, warm_up_passes

if TYPE_CHECKING:
    from kvscale.server.worker.lora_manager import LoRAManager

logger = logging.getLogger(__name__)


@dataclass
class PromptRows:
    """Logits rows predicting prompt tokens ``first_token .. first_token + count - 1`` of one sequence."""

    sched_index: int
    first_token: int
    count: int


@dataclass
class StepLogits:
    sample: torch.Tensor  # one row per entry of sample_rows
    sample_rows: list[int]  # scheduled indices whose chunk ended their tokens
    prompt: torch.Tensor  # the rows of prompt_rows, in order
    prompt_rows: list[PromptRows]
    extra: torch.Tensor | None = None  # the rows execute's ``extra_rows`` asked for, in order


# The longest chunk of output tokens attended as one-token rows: a grammar's forced run is a few
# tokens, and the decode kernel reads the paged cache in place, where a prefill chunk's attention
# gathers the whole context first (on CPU that gather cost more than the step it saved).
MAX_DECODE_ROWS_CHUNK = 32


def attends_as_decodes(start: int, num_new: int, num_prompt_tokens: int) -> bool:
    """Whether a chunk of ``num_new`` tokens from position ``start`` attends as that many decodes:
    only output tokens (a forced run after a sampled token), and only a short chunk; a prompt, or
    a preempted sequence recomputing from position 0, stays one prefill chunk."""
    return start >= num_prompt_tokens and 1 < num_new <= MAX_DECODE_ROWS_CHUNK


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


class ModelRunner:
    """Built without a KV cache: ``profile_run`` measures the largest step first, then the engine
    sizes the cache from it and calls ``allocate_kv_cache``."""

    def __init__(
        self, model: DecoderForCausalLM, block_size: int, dtype: torch.dtype, device: torch.device,
        *, kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.dtype = dtype
        # What the KV cache stores (--kv-cache-dtype); the model's dtype unless told otherwise.
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.device = device
        if device.type == "cpu":
            keep_freed_memory_for_reuse()
        self.kernels = kernels.backend_for(device)
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.max_model_len = 0
        self.host_cache: HostKVCache | None = None  # the second KV tier, when there is one
        self.decode_graphs: DecodeGraphs | None = None  # CUDA graphs of decode steps, unless eager
        self.block_table_rows = BlockTableRows(block_size)
        self.lora: LoRAManager | None = None  # --enable-lora's adapters (server/worker/lora_manager.py)
        # The sliding-window layers' own cache and tables, where the engine gives them a group (kv_groups.py).
        self.groups: KVGroups | None = None
        self.window_cache: torch.Tensor | None = None
        self.num_window_blocks = 0
        self.window_rows = BlockTableRows(block_size, "window_table")

    def registered_lora(self, name: str | None) -> str | None:
        """``name``, a LoRA adapter --lora-modules registered, or None (the base model); else ValueError."""
        if name is not None and (self.lora is None or name not in self.lora.paths):
            raise ValueError(f"LoRA adapter {name!r} is not registered (--enable-lora --lora-modules)")
        if name is not None and self.lora is not None:
            self.lora.on_host(name)  # one evicted from host memory is read again now, or refused here
        return name

    def allocate_kv_cache(self, num_blocks: int, max_model_len: int, num_window_blocks: int = 0) -> None:
        self.num_window_blocks = num_window_blocks
        self.kv_cache, self.kv_caches = self._new_kv_cache(num_blocks, num_window_blocks or None)
        self.model.build_rope_cache(max_model_len)
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        if self.device.type == "cuda":
            # Compile every Triton kernel now, so the first request (and /health) does not wait.
            self.warm_up()

    def _new_kv_cache(self, num_blocks: int, num_window_blocks: int | None = None,
                      ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """``num_window_blocks`` None: the window group, if any, as large as the full one (a start-up pass)."""
        spec = self.model.spec
        if self.groups is not None:
            full, self.window_cache, views = new_group_caches(
                self.groups, num_blocks, num_window_blocks or num_blocks, self.block_size, spec.num_kv_heads,
                spec.head_dim, self.kv_cache_dtype, self.device)
            return full, views
        # One allocation for the whole cache: [layer, k|v, block, offset, kv_head, head_dim].
        shape = (spec.num_layers, 2, num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        if self.device.type == "cpu":
            cache = lazily_zeroed(shape, self.kv_cache_dtype)
        else:
            cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
        return cache, [(cache[i, 0], cache[i, 1]) for i in range(spec.num_layers)]

    def profile_run(self, lengths: list[int], sampler: Sampler) -> StepProfile:
        return profile_step(self, lengths, sampler)

    def warm_up(self, num_tokens: int = 40) -> None:
        warm_up_passes(self, num_tokens)

    @torch.inference_mode()
    def capture_decode_graphs(self, max_num_seqs: int, capture: Capture | None = None) -> bool:
        """Capture pure-decode steps of up to ``max_num_seqs`` sequences (server/worker/decode_graphs.py);
        ``capture`` defaults to CUDA graphs on the runner's GPU. False, logged, where the model's
        steps cannot be captured: they run eagerly."""
        assert self.kv_cache is not None, "allocate_kv_cache first"
        why = why_not_captured(self.model)
        if why is not None:
            logger.info("kvscale engine: decode steps run eagerly, not as CUDA graphs: %s", why)
            return False
        self.decode_graphs = DecodeGraphs(
            self.model, self.kv_caches, self.kernels, max_num_seqs, -(-self.max_model_len // self.block_size),
            self.device, capture or cuda_graph_capture(self.device),
        )
        return True

    def allocate_host_cache(self, num_slots: int) -> None:
        """The second KV tier: ``num_slots`` blocks in host memory (pinned on a GPU), once."""
        assert self.kv_cache is not None, "allocate_kv_cache first"
        self.host_cache = HostKVCache(num_slots, self.kv_cache)

    @torch.inference_mode()
    def move_between_tiers(self, copies: TierCopies) -> None:
        """Demote and promote whole blocks (every layer, K and V) before the next forward."""
        if not copies:
            return
        assert self.host_cache is not None and self.kv_cache is not None, "no host tier"
        self.host_cache.run(self.kv_cache, copies)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (every layer, K and V) before they diverge."""
        if not copies:
            return
        cache = self.kv_cache
        assert cache is not None, "allocate_kv_cache first"
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        cache[:, :, dst] = cache[:, :, src]

    def copy_window_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write in the window group's cache."""
        if copies:
            assert self.window_cache is not None, "no window group"
            src, dst = (torch.tensor([c[i] for c in copies], device=self.device) for i in (0, 1))
            self.window_cache[:, :, dst] = self.window_cache[:, :, src]

    def prepare(
        self, scheduled: list[ScheduledSeq], in_flight: InFlightStep | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int], list[PromptRows]]:
        """Inputs for this step, the flattened rows whose logits are needed, and their sequences.

        A decode row whose token is still a placeholder takes it from ``in_flight``'s sampled
        tokens on the device (server/core/async_scheduling.py).

        A sequence gets logits to sample from when this step's chunk reaches its last token. A
        request that asked for prompt logprobs also gets the logits of every chunk position that
        predicts a prompt token; those rows follow the sampling rows. Attention sees a short chunk
        of output tokens (a grammar's forced run: attends_as_decodes) as that many one-token
        sequences over the same block table, each seeing the cache up to its own position.
        """
        bs = self.block_size
        num_seqs = len(scheduled)
        input_ids: list[int] = []
        query_start = [0] * (num_seqs + 1)
        tables = self.block_table_rows.tables(scheduled)
        # Single-token rows (decodes: most rows of most steps) as Python ints, longer chunks as
        # arrays; numpy's per-call cost on a one-element array was most of a decode row's time.
        positions_list: list[int] = []
        slots_list: list[int] = []
        pos_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        chunk_at: list[int] = []  # where each chunk's positions go among the single tokens
        fill_at: list[int] = []  # rows whose input is a placeholder
        fill_from: list[int] = []  # ... and the in-flight step's row that samples it
        sample_rows: list[int] = []
        prompt_rows: list[PromptRows] = []
        prompt_flat_rows: list[int] = []
        # Attention's view: one entry per sequence, or per token of a chunk that attends as decodes.
        attn_table: list[int] = []  # row of `tables` each entry reads
        attn_query_lens: list[int] = []
        attn_context_lens: list[int] = []
        for i, item in enumerate(scheduled):
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            if n == 1:
                token = seq.token_ids[start]
                if token == PLACEHOLDER_TOKEN:
                    assert in_flight is not None, "a placeholder with no step in flight"
                    fill_at.append(len(input_ids))
                    fill_from.append(in_flight.row_of[seq.seq_id])
                input_ids.append(token)
                positions_list.append(start)
                slots_list.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(seq.token_ids[start:end])
                pos = np.arange(start, end, dtype=np.int64)
                chunk_at.append(len(positions_list))
                pos_parts.append(pos)
                slot_parts.append(tables[i, pos // bs].astype(np.int64) * bs + pos % bs)
            if n > 1 and attends_as_decodes(start, n, seq.num_prompt_tokens):
                attn_table.extend([i] * n)
                attn_query_lens.extend([1] * n)
                attn_context_lens.extend(range(start + 1, end + 1))
            else:
                attn_table.append(i)
                attn_query_lens.append(n)
                attn_context_lens.append(end)
            query_start[i + 1] = query_start[i] + n
            if end == seq.num_tokens:
                sample_rows.append(i)
            if seq.request.params.prompt_logprobs is not None:
                # Position q's logits predict token q + 1; the last prompt position's are sampled.
                last = min(end, seq.num_prompt_tokens - 1)
                if last > start:
                    prompt_rows.append(PromptRows(i, start + 1, last - start))
                    prompt_flat_rows.extend(range(query_start[i], query_start[i] + last - start))
        is_decode = all(q_len == 1 for q_len in attn_query_lens)
        attn_tables = tables if attn_table == list(range(num_seqs)) else tables[attn_table]
        attn_query_start = np.concatenate([[0], np.cumsum(attn_query_lens)]).astype(np.int32)
        to_device = self._to_device
        positions = to_device(torch.from_numpy(_merge_rows(positions_list, chunk_at, pos_parts)))
        meta = AttentionMetadata(
            slot_mapping=to_device(torch.from_numpy(_merge_rows(slots_list, chunk_at, slot_parts))),
            block_tables=to_device(torch.from_numpy(attn_tables)),
            context_lens=to_device(torch.tensor(attn_context_lens, dtype=torch.int32)),
            query_start_loc=to_device(torch.from_numpy(attn_query_start)),
            is_decode=is_decode,
            kernels=self.kernels,
            max_query_len=max(attn_query_lens),
        )
        if not is_decode and not self.kernels.prefill_batches_decodes:
            meta.split = self._split(attn_query_lens, attn_tables, attn_query_start, attn_context_lens)
        if in_flight is not None and len(fill_at) == len(input_ids) and fill_from == list(range(len(in_flight.seqs))):
            # A steady decode batch: every input is the in-flight step's token of the same row.
            ids = in_flight.device_tokens
        else:
            ids = to_device(torch.tensor(input_ids, dtype=torch.long))
            if fill_at:
                assert in_flight is not None
                rows = to_device(torch.tensor(fill_from, dtype=torch.long))
                ids[to_device(torch.tensor(fill_at, dtype=torch.long))] = in_flight.device_tokens[rows]
        if self.groups is not None:
            meta.window = window_metadata(self.window_rows, scheduled, meta,
                                          None if attn_tables is tables else attn_table, to_device)
        flat_rows = [query_start[i + 1] - 1 for i in sample_rows] + prompt_flat_rows
        logits_indices = to_device(torch.tensor(flat_rows, dtype=torch.long))
        return ids, positions, meta, logits_indices, sample_rows, prompt_rows

    def _split(
        self, query_lens: list[int], tables: np.ndarray, query_start: np.ndarray, context_lens: list[int]
    ) -> DecodePrefillSplit | None:
        """Cut a mixed batch (attention's entries) into its single-token entries and the rest
        (None if not mixed)."""
        single = [i for i, q_len in enumerate(query_lens) if q_len == 1]
        if not single or len(single) == len(query_lens):
            return None
        multi = [i for i, q_len in enumerate(query_lens) if q_len > 1]
        prefill_rows = np.concatenate([np.arange(query_start[i], query_start[i + 1]) for i in multi])
        prefill_starts = np.cumsum([0] + [query_lens[i] for i in multi])
        lens = np.asarray(context_lens, dtype=np.int32)
        to_device = self._to_device
        return DecodePrefillSplit(
            decode_rows=to_device(torch.tensor([int(query_start[i]) for i in single], dtype=torch.long)),
            decode_block_tables=to_device(torch.from_numpy(tables[single])),
            decode_context_lens=to_device(torch.from_numpy(lens[single])),
            prefill_rows=to_device(torch.from_numpy(prefill_rows.astype(np.int64))),
            prefill_block_tables=to_device(torch.from_numpy(tables[multi])),
            prefill_context_lens=to_device(torch.from_numpy(lens[multi])),
            prefill_query_start_loc=to_device(torch.from_numpy(prefill_starts.astype(np.int32))),
        )

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A step input on the model's device; to a GPU from pinned memory without blocking, so
        the copies queue behind the previous step's work instead of waiting for it."""
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledSeq], copies: list[tuple[int, int]], in_flight: InFlightStep | None = None,
        extra_rows: list[int] | None = None,
    ) -> StepLogits:
        """Run one step; logits to sample from in the model's dtype (left on its device: the
        sampler argmaxes plain greedy rows where they are and converts only rows that need a
        distribution to float32), and float32 ones for prompt logprobs (host).
        Placeholder inputs come from ``in_flight``'s tokens. ``extra_rows``: flattened batch rows
        whose logits are wanted too, in the model's dtype (speculative decoding's drafts)."""
        self.copy_blocks(copies)
        ids, positions, meta, logits_indices, sample_rows, prompt_rows = self.prepare(scheduled, in_flight)
        if extra_rows:
            logits_indices = torch.cat([logits_indices, self._to_device(torch.tensor(extra_rows, dtype=torch.long))])
        if self.lora is not None:
            self.lora.set_step([item.seq.request.lora_name for item in scheduled],
                               [item.num_new_tokens for item in scheduled])
        hidden = None
        if self.decode_graphs is not None and meta.is_decode and not prompt_rows and len(ids) == len(sample_rows):
            hidden = self.decode_graphs.run(ids, positions, meta)
        if hidden is None:
            hidden = self.model.hidden_states(ids, positions, self.kv_caches, meta, logits_indices)
        # Not converted to float32 here: that copy of [rows, vocab] was most of a greedy bf16
        # step's sampling time on CPU, and an argmax over exactly converted values is the same.
        logits = self.model.compute_logits(hidden)
        num_sample = len(sample_rows)
        if extra_rows:
            end = len(logits) - len(extra_rows)
            return StepLogits(logits[:num_sample], sample_rows, logits[num_sample:end].float().cpu(), prompt_rows,
                              logits[end:])
        return StepLogits(logits[:num_sample], sample_rows, logits[num_sample:].float().cpu(), prompt_rows)


def _merge_rows(singles: list[int], chunk_at: list[int], chunks: list[np.ndarray]) -> np.ndarray:
    """The step's rows in batch order: ``singles`` with each chunk inserted before the single
    row it preceded (``chunk_at``: how many single rows came before it)."""
    if not chunks:
        return np.array(singles, dtype=np.int64)
    parts: list[np.ndarray] = []
    done = 0
    for at, chunk in zip(chunk_at, chunks, strict=True):
        parts.append(np.array(singles[done:at], dtype=np.int64))
        parts.append(chunk)
        done = at
    parts.append(np.array(singles[done:], dtype=np.int64))
    return np.concatenate(parts)
