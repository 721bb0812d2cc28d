"""Speculative decoding in the step loop (``--speculative-config``, n-gram or suffix drafts;
docs/server.md "Speculative decoding").

After the scheduler has given each decoding sequence its one token, ``attach`` lengthens the
chunk of each sequence speculation serves by its drafts (server/core/ngram_proposer.py or
server/core/suffix_proposer.py; with suffix decoding, ``forget`` caches each request's output as
it leaves, for later requests' drafts), within
the step's spare token budget and only into free blocks (a draft never preempts anything). The
drafts sit at the end of ``token_ids`` for the forward only: the scheduler registered the
sequence's full blocks before they were added, so no block holding a draft is ever hashed,
findable or announced in a KV event. ``Drafted.verify`` takes them out again, reads the target's argmax at every position of
the chunk (server/core/spec_decode.py) and hands back the tokens to append; ``Drafted.settle`` then
counts as computed only the positions whose tokens were kept and returns the blocks that held
nothing but rejected drafts to the pool (the rejected slots in a kept block are rewritten before
that block can be registered, as any slot is).

Only requests whose every token the device picks by argmax are served (async_scheduling.can_overlap:
greedy, n = 1, no logprobs, penalties, bias, min_tokens or grammar); the others decode one token
a step, as without the flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvscale.server.config import SUFFIX_TREE_MAX_NODES, EngineConfig, SpeculativeConfig
from kvscale.server.core.async_scheduling import can_overlap
from kvscale.server.core.block_pool import blocks_for
from kvscale.server.core.kv_cache_manager import KVCacheManager
from kvscale.server.core.ngram_proposer import propose_ngram
from kvscale.server.core.scheduler import SchedulerOutput
from kvscale.server.core.sequence import Request, Sequence, SequenceStatus
from kvscale.server.core.spec_decode import num_accepted, speculate_this_step
from kvscale.server.core.suffix_proposer import propose_suffix
from kvscale.server.core.suffix_tree import ResponseSuffixTree
from kvscale.server.worker.sampler import greedy_tokens


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, kv: KVCacheManager, max_num_batched_tokens: int,
                 max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # vLLM's counters (vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens).
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Suffix decoding's cache of earlier responses (None for n-gram, or with caching off).
        self.responses: ResponseSuffixTree | None = None
        if config.method == "suffix" and config.suffix_decoding_max_cached_requests > 0:
            self.responses = ResponseSuffixTree(config.suffix_decoding_max_tree_depth,
                                                config.suffix_decoding_max_cached_requests, SUFFIX_TREE_MAX_NODES)

    @classmethod
    def for_engine(cls, config: EngineConfig, kv: KVCacheManager, max_model_len: int) -> SpecDecoder | None:
        """The engine's decoder; None without --speculative-config."""
        if config.speculative_config is None:
            return None
        if kv.window is not None:
            raise ValueError("--speculative-config cannot serve a model with sliding-window layers yet")
        return cls(config.speculative_config, kv, config.max_num_batched_tokens, max_model_len)

    def attach(self, sched: SchedulerOutput) -> Drafted | None:
        """Drafts for this step's decodes, appended to their chunks; None when none were."""
        decodes = {item.seq for item in sched.scheduled if item.num_new_tokens == 1
                   and item.seq.num_computed_tokens + 1 == item.seq.num_tokens
                   and item.seq.num_computed_tokens >= item.seq.num_prompt_tokens}
        config = self.config
        if not speculate_this_step(len(decodes), config.disable_by_batch_size):
            return None
        spare = self.max_num_batched_tokens - sched.num_batched_tokens
        drafted = Drafted(self)
        row = 0
        for item in sched.scheduled:
            seq = item.seq
            if seq in decodes and spare > 0 and can_overlap(seq.params):
                # One token always comes from the step itself: drafts past max_tokens or the
                # context length would be computed only to be cut.
                room = min(config.num_speculative_tokens, spare, self.max_model_len - seq.num_tokens,
                           seq.request.max_tokens - seq.num_output_tokens - 1)
                drafts = self.propose(seq.token_ids, room) if room > 0 else []
                if drafts and self.kv.allocate_if_room(seq, 1 + len(drafts)):
                    drafted.drafts[seq] = drafts
                    drafted.rows.extend(range(row, row + len(drafts)))
                    seq.token_ids.extend(drafts)
                    item.num_new_tokens += len(drafts)
                    spare -= len(drafts)
            row += item.num_new_tokens
        return drafted if drafted.drafts else None

    def propose(self, tokens: list[int], room: int) -> list[int]:
        config = self.config
        if config.method == "suffix":
            return propose_suffix(tokens, self.responses, room, config.suffix_decoding_max_tree_depth,
                                  config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
        return propose_ngram(tokens, room, config.prompt_lookup_min, config.prompt_lookup_max)

    def forget(self, request: Request) -> None:
        """A request leaves the engine: its outputs join the cached responses (suffix decoding)."""
        if self.responses is not None:
            for seq in request.seqs:
                self.responses.add(seq.token_ids[seq.num_prompt_tokens:])

    def extra_stats(self) -> dict[str, float]:
        return {"spec_decode_num_drafts_total": float(self.num_drafts),
                "spec_decode_num_draft_tokens_total": float(self.num_draft_tokens),
                "spec_decode_num_accepted_tokens_total": float(self.num_accepted_tokens)}


@dataclass
class Drafted:
    """One step's drafts: per sequence its drafts, and their logits rows (flattened batch rows)."""

    decoder: SpecDecoder
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)

    def verify(self, row_seqs: list[Sequence], tokens: list[int],
               draft_logits: torch.Tensor | None) -> dict[Sequence, list[int]]:
        """The drafts out of ``token_ids`` (the forward has read them); each drafted row's token
        becomes the first token to append; returned: the tokens to append after it (the accepted
        drafts past the first, then the target's own token)."""
        assert draft_logits is not None, "the runner returns the drafts' rows"
        targets = greedy_tokens(draft_logits).tolist()
        decoder = self.decoder
        rest: dict[Sequence, list[int]] = {}
        at = 0
        row_of = {seq: i for i, seq in enumerate(row_seqs)}
        for seq, drafts in self.drafts.items():
            del seq.token_ids[-len(drafts):]
            seq_targets = targets[at:at + len(drafts)] + [tokens[row_of[seq]]]
            at += len(drafts)
            accepted = num_accepted(drafts, seq_targets)
            emitted = drafts[:accepted] + [seq_targets[accepted]]
            tokens[row_of[seq]] = emitted[0]
            rest[seq] = emitted[1:]
            decoder.num_drafts += 1
            decoder.num_draft_tokens += len(drafts)
            decoder.num_accepted_tokens += accepted
        return rest

    def settle(self) -> dict[Sequence, list[int]]:
        """Computed: the positions whose tokens were kept; blocks past the next token's, freed.
        Returns an empty map for the engine's verified tokens (none left to append)."""
        kv = self.decoder.kv
        for seq in self.drafts:
            if seq.status != SequenceStatus.RUNNING:
                continue  # finished: its blocks are already back
            seq.num_computed_tokens = seq.num_tokens - 1
            keep = blocks_for(seq.num_tokens, kv.block_size)
            if len(seq.block_table) > keep:
                kv.pool.free(seq.block_table[:keep - 1:-1])
                del seq.block_table[keep:]
        return {}
