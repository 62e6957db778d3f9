"""The persistent batch on the host: a step's inputs laid out with numpy over rows kept across steps.

Every running sequence holds a row of ``InputBatch.block_tables`` from its first step until the
scheduler reports it finished or preempted. A step copies into the row only the blocks appended
since the last step (one every ``block_size`` tokens), and computes positions, slots, context
lengths and sample rows for all sequences at once, instead of rebuilding per-sequence Python
lists every step (vLLM v1's ``InputBatch`` has the same shape). Plain numpy, no torch: the model
runner packs the arrays into its pinned buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagestream.engine.sequence import Sequence


@dataclass(slots=True)
class StepLayout:
    """One step's host inputs. Rows ``gather_dst`` of ``input_ids`` are placeholders for tokens
    still on the device: the runner fills them from the step in flight (rows ``gather_src``)."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    context_lens: np.ndarray  # [num_seqs] int32
    cu_seqlens_q: np.ndarray  # [num_seqs + 1] int32
    block_tables: np.ndarray  # [num_seqs, width] int32
    sample_rows: np.ndarray  # [num_sample] int64: the last token row of each sequence that samples
    sample_seqs: list[Sequence]
    gather_dst: np.ndarray  # [num_gather] int64
    gather_src: np.ndarray  # [num_gather] int64
    max_seqlen_q: int
    has_single_query_seqs: bool  # some sequence has one query token (a decode row)


class InputBatch:
    """Rows of block tables for the running sequences, and the step layout over them."""

    def __init__(self, num_rows: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_tables = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int32)
        self._num_synced = np.zeros(num_rows, dtype=np.int64)  # blocks of the row's table copied so far
        self._row_of: dict[Sequence, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def release(self, seqs: list[Sequence]) -> None:
        """Give back the rows of sequences that left the running set (finished or preempted:
        a preempted sequence comes back with a new block table, so it takes a fresh row)."""
        for seq in seqs:
            row = self._row_of.pop(seq, None)
            if row is not None:
                self._free_rows.append(row)

    def _take_row(self, seq: Sequence) -> int:
        if not self._free_rows:  # more sequences than rows (a caller outside the scheduler): grow
            old = self.block_tables.shape[0]
            self.block_tables = np.concatenate([self.block_tables, np.zeros_like(self.block_tables)])
            self._num_synced = np.concatenate([self._num_synced, np.zeros_like(self._num_synced)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        self._row_of[seq] = row
        self._num_synced[row] = 0
        return row

    def _rows(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
        """Each sequence's row, its table brought up to date; and each table's length in blocks."""
        row_of = self._row_of
        rows = [row_of.get(s, -1) for s in seqs]
        if -1 in rows:
            rows = [r if r >= 0 else self._take_row(s) for s, r in zip(seqs, rows)]
        rows_np = np.array(rows, dtype=np.int64)
        lens = np.fromiter([len(s.block_table) for s in seqs], dtype=np.int64, count=len(seqs))
        synced = self._num_synced[rows_np]
        # Tables only grow while a sequence holds its row (blocks are append-only; freeing one
        # ends the sequence's run, and with it the row): copy the new tail of each.
        for i in np.flatnonzero(lens != synced).tolist():
            row, old, new = rows[i], int(synced[i]), int(lens[i])
            if new < old:  # not expected; rewrite the row rather than trust it
                old = 0
                self.block_tables[row].fill(0)
            self.block_tables[row, old:new] = seqs[i].block_table[old:new]
            self._num_synced[row] = new
        return rows_np, lens

    def layout(self, num_scheduled_tokens: dict[Sequence, int], prev_rows: dict[Sequence, int]) -> StepLayout:
        """Lay out one step: ``num_scheduled_tokens`` in batch order; ``prev_rows`` maps each sequence
        sampled by the step still in flight to its row there (the source of its next input token)."""
        seqs = list(num_scheduled_tokens)
        n_seq = len(seqs)
        bs = self.block_size
        q_lens = np.fromiter(num_scheduled_tokens.values(), dtype=np.int64, count=n_seq)
        starts = np.fromiter([s.num_computed_tokens for s in seqs], dtype=np.int64, count=n_seq)
        known = np.fromiter([len(s.token_ids) for s in seqs], dtype=np.int64, count=n_seq)
        pending = np.fromiter([s.num_pending_tokens for s in seqs], dtype=np.int64, count=n_seq)
        rows, table_lens = self._rows(seqs)
        ends = starts + q_lens
        cu = np.zeros(n_seq + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        max_q = int(q_lens.max())

        if max_q == 1:  # decode only: one token per sequence, the common step
            positions = starts
            token_rows = rows
        else:
            seq_of_token = np.repeat(np.arange(n_seq), q_lens)
            positions = np.arange(num_tokens, dtype=np.int64) + (starts - cu[:-1])[seq_of_token]
            token_rows = rows[seq_of_token]
        slot_mapping = self.block_tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs

        input_ids = np.zeros(num_tokens, dtype=np.int64)
        on_device = starts >= known  # its input is the token sampled by the step in flight (a decode row)
        gather = np.flatnonzero(on_device)
        gather_dst = cu[gather]
        gather_src = np.array([prev_rows[seqs[i]] for i in gather.tolist()], dtype=np.int64)
        if gather.size < n_seq:
            one = np.flatnonzero((q_lens == 1) & ~on_device).tolist()
            if one:
                input_ids[cu[one]] = [seqs[i].token_ids[s] for i, s in zip(one, starts[one].tolist())]
            for i in np.flatnonzero(q_lens > 1).tolist():
                s, e = int(starts[i]), int(ends[i])
                input_ids[cu[i] : cu[i + 1]] = seqs[i].token_ids[s:e]

        sample = ends == known + pending  # caught up: this step samples its next token
        if sample.all():
            sample_rows, sample_seqs = cu[1:] - 1, seqs
        else:
            idx = np.flatnonzero(sample)
            sample_rows, sample_seqs = cu[1:][idx] - 1, [seqs[i] for i in idx.tolist()]
        width = max(int(table_lens.max()), 1)
        return StepLayout(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            context_lens=ends.astype(np.int32),
            cu_seqlens_q=cu.astype(np.int32),
            block_tables=self.block_tables[rows, :width],
            sample_rows=sample_rows,
            sample_seqs=sample_seqs,
            gather_dst=gather_dst,
            gather_src=gather_src,
            max_seqlen_q=max_q,
            has_single_query_seqs=max_q == 1 or bool((q_lens == 1).any()),
        )
