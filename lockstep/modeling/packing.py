"""The layout of one packed micro-batch, as the trainer's model code sees it.

The trainer concatenates a micro-batch's rows into ONE sequence ([1, T]): row i starts at
`starts[i]`, holds `lengths[i]` real tokens and takes `widths[i]` positions (its length padded to
whole blocks), rows back to back, positions restarting at 0 for each row. Every layer that mixes
tokens must keep rows apart: attention runs per row span (`attention.py`), stateful sequence
mixers (Gated DeltaNet, Mamba-2) restart their state at every row block (`mixers.py`: all rows in
one varlen call per kernel), and everything else is per token. The layout is published for the
duration of a forward (and its backward: activation checkpointing recomputes layers there) with
`packed_rows(...)`.

A plain slot, not a ContextVar: CUDA autograd runs backward on its own thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Packing:
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    widths: tuple[int, ...]

    def spans(self) -> list[tuple[int, int]]:
        """(start, length) of each row's real tokens."""
        return list(zip(self.starts, self.lengths, strict=True))

    def blocks(self) -> list[tuple[int, int]]:
        """(start, width) of each row's positions, padding included; they tile the sequence."""
        return list(zip(self.starts, self.widths, strict=True))

    # Device tensors derived from the layout, built once per micro-batch (every recurrent layer
    # of the forward and its backward reads them), not once per layer call.
    _tensors: dict[tuple[str, str], torch.Tensor] = field(
        default_factory=dict, compare=False, repr=False
    )

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        """The blocks' bounds [rows + 1] (int64) on `device`: the varlen kernels' rows."""
        key = ("cu_seqlens", str(device))
        if key not in self._tensors:
            self._tensors[key] = self.cu_seqlens_cpu().to(device)
        return self._tensors[key]

    def cu_seqlens_cpu(self) -> torch.Tensor:
        """The blocks' bounds on the host (a kernel sizes its launch from them without a sync)."""
        key = ("cu_seqlens", "cpu")
        if key not in self._tensors:
            bounds = [0, *(s + w for s, w in self.blocks())]
            self._tensors[key] = torch.tensor(bounds, dtype=torch.int64)
        return self._tensors[key]

    def index(
        self, name: str, device: torch.device, build: Callable[[Packing], Sequence[int]]
    ) -> torch.Tensor:
        """An int64 index tensor derived from the layout by `build` (a kernel's own layout of
        the rows), built once per micro-batch, name and device."""
        key = (name, str(device))
        if key not in self._tensors:
            self._tensors[key] = torch.tensor(build(self), dtype=torch.int64).to(device)
        return self._tensors[key]


class _Current:
    packing: Packing | None = None


def current() -> Packing | None:
    return _Current.packing


@contextmanager
def packed_rows(
    starts: Sequence[int], lengths: Sequence[int], widths: Sequence[int]
) -> Iterator[None]:
    """Publish the layout of the packed [1, T] sequence run inside the context."""
    previous = _Current.packing
    _Current.packing = Packing(tuple(starts), tuple(lengths), tuple(widths))
    try:
        yield
    finally:
        _Current.packing = previous
