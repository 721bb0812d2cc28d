"""The second KV tier's decisions, as pure functions: what to demote ahead, and swap or recompute.

Kept apart from the pool and the scheduler so each rule is one function with its own tests.
"""

from __future__ import annotations

# Upper bounds (seconds) of the restore-latency histogram: one step's batch of promotions.
RESTORE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

# Demote ahead of need once fewer than this fraction of tier-1 blocks is fresh, so a step that
# needs blocks finds them without copying first. Small: a block demoted ahead costs a promotion
# if it is hit again, where left in tier 1 it would have cost nothing.
DEFAULT_WATERMARK = 0.02


def watermark_blocks(num_blocks: int, fraction: float = DEFAULT_WATERMARK) -> int:
    """Fresh tier-1 blocks to keep in hand (at least one, when the fraction is not zero)."""
    if fraction <= 0:
        return 0
    return max(1, int(num_blocks * fraction))


def blocks_to_demote_ahead(num_fresh: int, num_cached_free: int, watermark: int) -> int:
    """How many of the least recently used cached-free tier-1 blocks to demote now.

    Enough to bring the fresh count back up to the watermark, never more than are cached-free
    (held blocks are never demoted ahead: someone may be writing them).
    """
    return max(0, min(watermark - num_fresh, num_cached_free))


def swap_is_cheaper(
    num_blocks: int,
    block_bytes: int,
    num_tokens: int,
    copy_bytes_per_s: float,
    prefill_tokens_per_s: float,
) -> bool:
    """Whether a preempted sequence's full blocks should go down to tier 2 (and come back up)
    rather than be recomputed when it resumes.

    Swap costs two copies of its blocks (down now, up on resume); recompute costs a prefill of
    its tokens. An unmeasured rate (0) favours swap: a host copy of a block is orders of
    magnitude cheaper than computing it on every device measured so far, and the first swap
    measures the copy rate.
    """
    if num_blocks <= 0:
        return False
    if copy_bytes_per_s <= 0 or prefill_tokens_per_s <= 0:
        return True
    swap_s = 2 * num_blocks * block_bytes / copy_bytes_per_s
    recompute_s = num_tokens / prefill_tokens_per_s
    return swap_s < recompute_s
