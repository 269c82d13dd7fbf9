"""How the local trainer lays a fused pass's rows out: cut into micro-batches, each ONE sequence.

`micro_batches` orders rows by length and cuts them into micro-batches of at most a budget of
tokens; `pack` concatenates a micro-batch's rows into one [1, T] sequence, each padded only to a
whole block of 8 tokens, positions restarting per row, and names the adapter of each block (the
LoRA routing). On the generic path (`alone`) a micro-batch is one row, unpadded.
"""

from __future__ import annotations

import contextlib
import itertools
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch

from lockstep.modeling.packing import packed_rows
from lockstep.workers.local.pass_state import Row

PAD_MULTIPLE = 8  # a row takes whole blocks of 8 tokens: every GEMM has M >= 8 rows


def padded(length: int) -> int:
    return -(-length // PAD_MULTIPLE) * PAD_MULTIPLE


def alone(lengths: list[int]) -> list[list[int]]:
    """One row per micro-batch (the generic path), longest first."""
    return [[i] for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))]


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices cut into micro-batches: longest first, each at most `budget` tokens once its
    rows are packed (each padded to whole blocks); a row longer than the budget goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    used = 0
    for i in order:
        need = padded(lengths[i])
        if batches and used + need <= budget:
            batches[-1].append(i)
            used += need
        else:
            batches.append([i])
            used = need
    return batches


@dataclass(frozen=True)
class PackedSequence:
    """One micro-batch as one sequence: row i's tokens at starts[i]..starts[i] + its length."""

    input_ids: torch.Tensor  # [1, T] on the CPU
    positions: torch.Tensor  # [1, T], restarting at 0 for each row
    starts: list[int]
    blocks: list[str]  # the adapter of each block (the routing); the row's on the generic path
    lengths: list[int]
    widths: list[int]
    packed: bool

    def layout(self) -> AbstractContextManager[None]:
        """Publishes the row spans to the model code for a forward (and its backward)."""
        if not self.packed:
            return contextlib.nullcontext()
        return packed_rows(self.starts, self.lengths, self.widths)


def pack(rows: list[Row], packed: bool) -> PackedSequence:
    """Rows side by side, each padded to whole blocks when `packed` (else one row, unpadded).
    No padding mask: a pad position is outside every attention span and every op on it is per
    token, so nothing computed there reaches a real token or a loss."""
    lengths = [r.length for r in rows]
    widths = [padded(n) for n in lengths] if packed else lengths
    *starts, total = itertools.accumulate(widths, initial=0)
    input_ids = torch.zeros(1, total, dtype=torch.long)
    positions = torch.zeros(1, total, dtype=torch.long)
    for row, start in zip(rows, starts, strict=True):
        span = slice(start, start + row.length)
        input_ids[0, span] = torch.from_numpy(np.asarray(row.datum.tokens, np.int64))
        positions[0, span] = torch.arange(row.length)
    if packed:
        per_row = zip(rows, widths, strict=True)
        blocks = [r.model_id for r, w in per_row for _ in range(w // PAD_MULTIPLE)]
    else:
        blocks = [rows[0].model_id]
    return PackedSequence(input_ids, positions, starts, blocks, lengths, widths, packed)
