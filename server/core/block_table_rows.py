"""The block tables of a step as one numpy array, kept between steps so that a step copies only
the entries that may have changed.

Turning every scheduled sequence's table (a Python list) into a numpy row was most of building a
256-sequence decode step's inputs (~3.6 us a row on an EPYC: ~0.9 ms a step), the host work
that paces a GPU's step (docs/performance.md, "GPU: the decode step and the kernels"). A sequence
keeps a row here while it is scheduled step after step; a step rewrites that row only from the
block its new tokens start in, which is where a table changes in place (a new block appended,
or the copy-on-write of the partial block it writes next: kv_cache_manager). Every other change
gives the sequence a new list (freed, preempted, a prefix hit, forked), and a new list is copied
whole. A window group's table (server/core/window_group.py) also has entries freed in place,
all before the block its new tokens start in: never read again, so a row may keep them stale.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from kvscale.server.core.scheduler import ScheduledSeq


class BlockTableRows:
    def __init__(self, block_size: int, table: str = "block_table") -> None:
        self.block_size = block_size
        # Which table of a sequence: block_table, or a window group's window_table (window_group.py).
        self._table_of = attrgetter(table)
        self._array = np.zeros((0, 0), dtype=np.int32)  # one row per sequence kept
        self._free: list[int] = []  # rows nobody keeps
        self._row_of: dict[int, int] = {}  # seq_id -> its row
        # Per row: the list it mirrors and the step that last used it. Plain lists updated in
        # place: a step leaves no new object alive behind it (each would be promoted by the
        # garbage collector and bring its next full pass closer).
        self._mirrors: list[list[int] | None] = []
        self._used_at: list[int] = []
        self._step = 0

    def tables(self, scheduled: list[ScheduledSeq]) -> np.ndarray:
        """[len(scheduled), longest table] int32: row i is scheduled[i]'s table, zero-padded.
        Sequences kept from earlier steps but not scheduled in this one give their rows up."""
        table_of = self._table_of
        width = max(len(table_of(item.seq)) for item in scheduled)
        row_of = self._row_of
        self._reserve(len(row_of) + len(scheduled), width)
        self._step += 1
        array, bs, step = self._array, self.block_size, self._step
        mirrors, used_at = self._mirrors, self._used_at
        rows: list[int] = []
        for item in scheduled:
            seq = item.seq
            table: list[int] = table_of(seq)
            row = row_of.get(seq.seq_id)
            if row is not None and mirrors[row] is table:
                # Kept from the step before, when the table covered every token computed since:
                # from the block being written on, usually one entry. Ints, one by one.
                for k in range(seq.num_computed_tokens // bs, len(table)):
                    array[row, k] = table[k]
            else:
                if row is None:
                    row = row_of[seq.seq_id] = self._free.pop()
                mirrors[row] = table
                array[row, : len(table)] = table
                array[row, len(table) :] = 0
            used_at[row] = step
            rows.append(row)
        if len(row_of) > len(rows):
            for seq_id, row in list(row_of.items()):
                if used_at[row] != step:
                    del row_of[seq_id]
                    mirrors[row] = None
                    self._free.append(row)
        return array[rows, :width]

    def _reserve(self, num_rows: int, width: int) -> None:
        """Room for ``num_rows`` rows of ``width`` entries (kept rows stay where they are)."""
        rows, columns = self._array.shape
        if rows >= num_rows and columns >= width:
            return
        grown = np.zeros((max(rows, num_rows), max(columns, width)), dtype=np.int32)
        grown[:rows, :columns] = self._array
        self._array = grown
        added = grown.shape[0] - rows
        self._free.extend(range(rows, grown.shape[0]))
        self._mirrors.extend([None] * added)
        self._used_at.extend([0] * added)
