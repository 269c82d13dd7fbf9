"""Which adapter each batch row (or each block of one packed sequence) uses, for the forward
in flight. One `RoutingSlot` is shared by every multi-LoRA layer of a `LoraModel`; the engines
set its `Routing` around a forward (and its backward) with `LoraModel.row_adapters(...)`.

A "row" of the routing is a batch row, or a fixed-size block of one packed sequence (the trainer
concatenates a micro-batch's rows, each padded to whole blocks, so every block has one adapter).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Segment:
    """The batch rows of one adapter: a slice when contiguous, else an index."""

    adapter_id: str
    start: int
    stop: int
    index: torch.Tensor | None  # None: rows start..stop-1, contiguous
    mask: torch.Tensor | None  # [n * per_row] fp32, 0 on padding; None: no padding


class Routing:
    """Which adapter each batch row uses, grouped into per-adapter segments once per layout.

    Rows of one adapter go through that adapter's matmuls together ([n * tokens, in] @ A.T), never
    a per-row copy of the weights; when the segments lie side by side, one grouped GEMM pair
    covers every adapter of a layer on CUDA (`linear_lora.MultiLoRALinear`).
    Callers that can (the training engine) order rows by adapter, so segments are plain slices.
    """

    def __init__(self, adapter_ids: Sequence[str | None], valid: torch.Tensor | None) -> None:
        self.adapter_ids = list(adapter_ids)
        self.valid = valid
        self._valid_cpu = None if valid is None else valid.detach().to("cpu", torch.bool)
        self._segments: dict[tuple[int, torch.device], list[Segment]] = {}
        # Device tensors the layers derive from this layout (group ends, per-token scales),
        # built by the first layer that needs one and shared by every later layer and the backward.
        self.constants: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._tokens: dict[tuple[int, torch.device], tuple[list[str], torch.Tensor]] = {}
        self._cast: tuple[weakref.ref[torch.Tensor], int, torch.Tensor] | None = None

    def token_adapters(self, tokens: int, device: torch.device) -> tuple[list[str], torch.Tensor]:
        """For a flattened [rows * per_row] token axis: the adapters present, and each token's
        index into them (int64 [tokens], -1 for a row without an adapter). Cached per layout."""
        key = (tokens, device)
        if key not in self._tokens:
            rows = len(self.adapter_ids)
            if rows == 0 or tokens % rows:
                raise ValueError(f"{tokens} tokens do not split into {rows} routed rows")
            names = sorted({a for a in self.adapter_ids if a is not None})
            index = {name: i for i, name in enumerate(names)}
            per_row = torch.tensor(
                [-1 if a is None else index[a] for a in self.adapter_ids], dtype=torch.long
            )
            self._tokens[key] = (
                names,
                per_row.repeat_interleave(tokens // rows).to(device),
            )
        return self._tokens[key]

    def cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x in `dtype` for the LoRA layers that read it: cast once for the layers that read the
        same tensor one after another (q, k and v read one normed input; gate and up another),
        the last cast kept while x lives unchanged. Autograd sums the readers' gradients into
        the one cast, so their backward casts it back once too."""
        if x.dtype == dtype:
            return x
        # Inference tensors keep no version counter (nothing in inference mode writes a layer's
        # input in place between its readers).
        version = -1 if x.is_inference() else x._version
        last = self._cast
        if last is not None and last[0]() is x and last[1] == version and last[2].dtype == dtype:
            return last[2]
        out = x.to(dtype)
        self._cast = (weakref.ref(x), version, out)
        return out

    def narrow(self, start: int, stop: int) -> Routing:
        """The routing of rows start..stop-1 alone (padding masks are not carried over)."""
        return Routing(self.adapter_ids[start:stop], None)

    def segments(self, x: torch.Tensor, in_features: int) -> list[Segment]:
        """Segments for x viewed as [rows, per_row, in], in row order (cached per layout)."""
        rows = len(self.adapter_ids)
        # A batch of `rows` rows, ONE packed sequence routed in `rows` equal blocks, or either
        # flattened to [tokens, in] (MoE blocks call their shared expert that way).
        whole = x.numel() % max(1, rows * in_features) == 0
        if not (x.shape[0] == rows or (whole and (x.shape[0] == 1 or x.dim() == 2))):
            raise ValueError(f"batch has {x.shape[0]} rows but {rows} adapter ids were routed")
        per_row = x.numel() // (rows * in_features) if rows else 0
        key = (per_row, x.device)
        if key not in self._segments:
            self._segments[key] = self._build(per_row, x.device)
        return self._segments[key]

    def _build(self, per_row: int, device: torch.device) -> list[Segment]:
        groups: dict[str, list[int]] = {}
        for row, aid in enumerate(self.adapter_ids):
            if aid is not None:
                groups.setdefault(aid, []).append(row)
        masked = self.valid is not None and tuple(self.valid.shape) == (
            len(self.adapter_ids),
            per_row,
        )
        out = []
        for aid, rows in groups.items():
            contiguous = rows == list(range(rows[0], rows[-1] + 1))
            index = None if contiguous else torch.tensor(rows, dtype=torch.long, device=device)
            mask = None
            if masked:
                assert self.valid is not None and self._valid_cpu is not None
                if not bool(self._valid_cpu[rows].all()):
                    sel = self.valid[rows[0] : rows[-1] + 1] if index is None else self.valid[index]
                    mask = sel.to(device, torch.float32).reshape(-1)
            out.append(Segment(aid, rows[0], rows[-1] + 1, index, mask))
        return sorted(out, key=lambda seg: seg.start)


class RoutingSlot:
    """Shared by every MultiLoRALinear of a LoraModel: the routing of the current forward."""

    def __init__(self) -> None:
        self.current: Routing | None = None
