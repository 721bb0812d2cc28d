"""The step's block tables kept between steps (server/core/block_table_rows.py) against building them
from the sequences' lists every step, through every way a table changes."""

from __future__ import annotations

import random

import numpy as np

from kvscale.server.core.block_table_rows import BlockTableRows
from kvscale.server.core.scheduler import ScheduledSeq
from kvscale.server.core.sequence import Request, Sequence
from kvscale.server.outputs import RequestMetrics
from kvscale.server.sampling_params import SamplingParams

BS = 4


def make_seq(num_blocks: int, rng: random.Random) -> Sequence:
    request = Request("r", None, [1], SamplingParams(), None, RequestMetrics(0.0), 8)
    seq = Sequence(request, 0, [1], 1)
    seq.block_table = [rng.randrange(1000) for _ in range(num_blocks)]
    seq.num_computed_tokens = max(num_blocks * BS - rng.randrange(1, BS + 1), 0)
    return seq


def expected(scheduled: list[ScheduledSeq]) -> np.ndarray:
    width = max(len(item.seq.block_table) for item in scheduled)
    tables = np.zeros((len(scheduled), width), dtype=np.int32)
    for i, item in enumerate(scheduled):
        tables[i, : len(item.seq.block_table)] = item.seq.block_table
    return tables


def test_kept_rows_follow_every_change_a_table_goes_through() -> None:
    rng = random.Random(0)
    rows = BlockTableRows(BS)
    live = [make_seq(rng.randrange(1, 6), rng) for _ in range(6)]
    for _ in range(400):
        for seq in live:
            change = rng.random()
            table = seq.block_table
            write_block = seq.num_computed_tokens // BS
            if change < 0.3:  # a decode moved on; every BS tokens it needs a new block
                seq.num_computed_tokens += 1
                if seq.num_computed_tokens // BS >= len(table):
                    table.append(rng.randrange(1000))
            elif change < 0.4 and write_block < len(table):  # copy-on-write of the block it writes
                table[write_block] = rng.randrange(1000)
            elif change < 0.45:  # freed (preempted) and allocated again: a new list
                seq.block_table = [rng.randrange(1000) for _ in range(rng.randrange(1, 4))]
                seq.num_computed_tokens = 0
            elif change < 0.5:  # a prefix hit gives a longer new list
                seq.block_table = [rng.randrange(1000) for _ in range(rng.randrange(3, 9))]
                seq.num_computed_tokens = (len(seq.block_table) - 1) * BS
        if rng.random() < 0.1:
            live.pop(rng.randrange(len(live)))  # finished: never scheduled again
        while len(live) < 3 or rng.random() < 0.1:
            live.append(make_seq(rng.randrange(1, 6), rng))
        # Some sequences sit a step out (preempted, over the budget), in any order.
        scheduled = [ScheduledSeq(seq, 1) for seq in live if rng.random() < 0.85] or [ScheduledSeq(live[0], 1)]
        rng.shuffle(scheduled)
        got = rows.tables(scheduled)
        np.testing.assert_array_equal(got, expected(scheduled))


def test_a_row_handed_to_a_new_sequence_has_no_entries_of_the_last() -> None:
    rng = random.Random(1)
    rows = BlockTableRows(BS)
    long_seq = make_seq(8, rng)
    rows.tables([ScheduledSeq(long_seq, 1)])
    short_seq, other = make_seq(2, rng), make_seq(8, rng)
    got = rows.tables([ScheduledSeq(short_seq, 1), ScheduledSeq(other, 1)])
    np.testing.assert_array_equal(got, expected([ScheduledSeq(short_seq, 1), ScheduledSeq(other, 1)]))
    assert not got[0, 2:].any()
