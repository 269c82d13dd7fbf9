"""Multi-tenant LoRA on a linear layer: `MultiLoRALinear` computes `base(x) + scale_a * (x @ A_a.T)
@ B_a.T` with `a` = the adapter of x's row (`lora.LoraModel` puts it in place of every linear
LoRA target). Each `LinearSlot` holds the adapters of the layer's output rows (all of them, or
one part of a fused projection Tinker trains as separate LoRA).

Rows are grouped by adapter (sorted segments, `routing.py`): each adapter's rows go through that
adapter's own A / B, so a row's output does not depend on which other rows or adapters share the
batch (beyond float rounding), and no row copies adapter weights. When the segments lie side by
side (the trainer orders rows by adapter) the K adapters of a slot take, on CUDA, ONE grouped GEMM
pair over their runs of tokens (`torch._grouped_mm`, ranks zero-padded to the largest; group ends
and per-token scales built once per routing); on the CPU one split of the run and a GEMM pair per
adapter (`GROUPED_DEVICES`). Otherwise each adapter takes one GEMM pair of its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.modeling.grouped_gemm import grouped_mm, lora_stack
from lockstep.modeling.routing import Routing, RoutingSlot, Segment


class LinearSlot:
    """The adapters' LoRA of a linear layer's output rows start..start+out_features-1 (all of
    them, or one part of a fused projection Tinker trains as separate LoRA)."""

    def __init__(self, owner: MultiLoRALinear, start: int, out_features: int) -> None:
        self._owner = owner
        self.in_features = owner.in_features
        self.out_features = out_features
        self.start = start
        self.lora_A: dict[str, nn.Parameter] = {}
        self.lora_B: dict[str, nn.Parameter] = {}
        self.scale: dict[str, float] = {}

    @property
    def device(self) -> torch.device:
        return self._owner.weight.device

    def adapter(self, adapter_id: str) -> tuple[nn.Parameter, nn.Parameter, float] | None:
        """(A, B, scale) of `adapter_id` here; None when it does not train this slot."""
        if adapter_id not in self.lora_A:
            return None
        return self.lora_A[adapter_id], self.lora_B[adapter_id], self.scale[adapter_id]

    def groupable(self, base: torch.dtype) -> bool:
        """Whether the grouped kernel takes this slot's sizes in the GEMMs' dtype (fp32, or
        `base` under GROUPED_IN_BASE_DTYPE): both feature dims whole 16-byte rows (real
        models' are; else one GEMM pair each)."""
        align = 16 // (base.itemsize if GROUPED_IN_BASE_DTYPE else 4)
        return self.in_features % align == 0 and self.out_features % align == 0

    def pair(self, seg: Segment, xs: torch.Tensor, per_row: int) -> torch.Tensor:
        """One adapter's LoRA over its rows xs [n, per_row, in]: one GEMM pair with the adapter's
        own weights (no copies), M = its tokens, a multiple of 8 in the trainer, so the kernel
        class a tenant's tokens take does not depend on what they are packed with, as for the
        base matmul. [n, per_row, out]."""
        a, b = self.lora_A[seg.adapter_id], self.lora_B[seg.adapter_id]
        n = xs.shape[0]
        h = xs.reshape(n * per_row, -1).to(a.dtype) @ a.t()
        scale = self.scale[seg.adapter_id]
        h = h * scale if seg.mask is None else h * (seg.mask.view(n * per_row, 1) * scale)
        return (h @ b.t()).view(n, per_row, -1)

    def grouped(
        self, xs: torch.Tensor, segments: list[Segment], per_row: int, routing: Routing
    ) -> torch.Tensor:
        """Every segment's LoRA in ONE grouped GEMM pair: xs [n, per_row, in] holds the
        segments' rows back to back, adapter after adapter. Ranks differ between adapters, so A
        and B are zero-padded to the largest (exact: the padded rank columns add zeros); each
        group's product is its adapter's own, so a tenant's numbers do not depend on who else
        is in the batch beyond float rounding. [n, per_row, out]."""
        ids = [s.adapter_id for s in segments]
        # The GEMMs' dtype: the adapters' (fp32), or the base weights' where GROUPED_IN_BASE_DTYPE
        # says so (bf16 is the CUDA grouped kernel's fast path; A and B stay fp32 parameters).
        dtype = xs.dtype if GROUPED_IN_BASE_DTYPE else self.lora_A[ids[0]].dtype
        a, b = lora_stack([(self.lora_A[i], self.lora_B[i]) for i in ids], dtype)  # [G, r, in]
        ends, token_scale = self._group_layout(segments, per_row, routing, xs.device)
        flat = xs.reshape(-1, self.in_features).to(dtype)
        h = grouped_mm(flat, a.mT, ends) * token_scale.unsqueeze(1).to(dtype)
        return grouped_mm(h, b.mT, ends).view(xs.shape[0], per_row, self.out_features)

    def _group_layout(
        self, segments: list[Segment], per_row: int, routing: Routing, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 group ends, fp32 per-token scale) of the segments on `device`. Built once per
        routing and kept in it: every layer of a forward (and its backward) with the same
        adapters shares them, so a layer call copies nothing from the host."""
        scales = tuple(self.scale[s.adapter_id] for s in segments)
        key = ("grouped", per_row, device, scales, *((s.start, s.stop) for s in segments))
        cached = routing.constants.get(key)
        if cached is not None:
            return cached
        counts = torch.tensor([(s.stop - s.start) * per_row for s in segments])
        ends = counts.cumsum(0).to(device, torch.int32)
        token_scale = torch.tensor(scales, dtype=torch.float32).repeat_interleave(counts)
        token_scale = token_scale.to(device)
        masks = [s.mask for s in segments]
        if any(m is not None for m in masks):
            token_scale = token_scale * torch.cat(
                [
                    m if m is not None else token_scale.new_ones(int(c))
                    for m, c in zip(masks, counts.tolist(), strict=True)
                ]
            )
        routing.constants[key] = (ends, token_scale)
        return ends, token_scale


class MultiLoRALinear(nn.Module):
    """A frozen linear layer plus any number of LoRA adapters, applied per batch row.

    Keeps the wrapped layer's `weight` / `bias` as its own parameters so base state-dict keys do
    not change. Different adapters may have different ranks; an adapter may skip this layer.
    The base matmul runs in the model's dtype; the adapter path in fp32 (the adapters' dtype).
    `parts` ((start, stop) row ranges): one LoRA slot per part instead of one for the layer.
    """

    def __init__(
        self, base: nn.Linear, slot: RoutingSlot, parts: Sequence[tuple[int, int]] = ()
    ) -> None:
        super().__init__()
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self._slot = slot
        ranges = list(parts) or [(0, self.out_features)]
        self.slots = [LinearSlot(self, start, stop - start) for start, stop in ranges]

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        routing = self._slot.current
        if routing is None:
            return y
        for slot in self.slots:
            delta = self._delta(slot, x, routing)
            if delta is None:
                continue
            tail = self.out_features - slot.start - slot.out_features
            if slot.start or tail:
                delta = F.pad(delta, (slot.start, tail))
            y = y + delta.to(y.dtype).view(y.shape)
        return y

    def _delta(self, slot: LinearSlot, x: torch.Tensor, routing: Routing) -> torch.Tensor | None:
        """[rows, per_row, slot.out_features] LoRA deltas of the adapters routed to x's rows."""
        if not slot.lora_A:
            return None
        segments = [s for s in routing.segments(x, self.in_features) if s.adapter_id in slot.lora_A]
        if not segments:
            return None
        base_dtype = x.dtype
        if not GROUPED_IN_BASE_DTYPE:  # the adapters' dtype, cast once for every reader of x
            x = routing.cast(x, next(iter(slot.lora_A.values())).dtype)
        rows = len(routing.adapter_ids)  # batch rows, or blocks of one packed sequence
        x3 = x.reshape(rows, -1, self.in_features)
        per_row = x3.shape[1]
        run = contiguous_run(segments)
        if run is None:
            xs = [
                x3.index_select(0, s.index) if s.index is not None else x3[s.start : s.stop]
                for s in segments
            ]
            deltas = [slot.pair(seg, xi, per_row) for seg, xi in zip(segments, xs, strict=True)]
            return _assemble(segments, deltas, rows, per_row, slot.out_features)
        covered = x3 if (run.start, run.stop) == (0, rows) else x3[run]
        if len(segments) > 1 and x.device.type in GROUPED_DEVICES and slot.groupable(base_dtype):
            delta = slot.grouped(covered, segments, per_row, routing)
        else:
            # One split of the run (its backward one concatenation, not a zero-filled gradient
            # of x per adapter), then each adapter's own GEMM pair over its tokens.
            pieces = torch.split(covered, [s.stop - s.start for s in segments])
            deltas = [slot.pair(seg, xi, per_row) for seg, xi in zip(segments, pieces, strict=True)]
            delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas)
        return _assemble_run(delta, run, rows, per_row, slot.out_features)

    def extra_repr(self) -> str:
        adapters = {a for s in self.slots for a in s.lora_A}
        return f"in={self.in_features}, out={self.out_features}, adapters={len(adapters)}"


def _assemble(
    segments: list[Segment], deltas: list[torch.Tensor], rows: int, per_row: int, width: int
) -> torch.Tensor:
    """[rows, per_row, width] from per-segment deltas; rows without an adapter get zeros."""
    first = deltas[0]
    if len(segments) == 1 and segments[0].index is None and first.shape[0] == rows:
        return first
    if all(s.index is None for s in segments):
        parts, at = [], 0
        for seg, d in zip(segments, deltas, strict=True):
            if seg.start > at:
                parts.append(first.new_zeros(seg.start - at, per_row, width))
            parts.append(d)
            at = seg.stop
        if at < rows:
            parts.append(first.new_zeros(rows - at, per_row, width))
        return torch.cat(parts)
    out = first.new_zeros(rows, per_row, width)
    for seg, d in zip(segments, deltas, strict=True):
        index = seg.index
        if index is None:
            index = torch.arange(seg.start, seg.stop, device=d.device)
        out = out.index_add(0, index, d)
    return out


def _assemble_run(
    delta: torch.Tensor, run: slice, rows: int, per_row: int, width: int
) -> torch.Tensor:
    """[rows, per_row, width] from the deltas of rows `run`; the rows outside get zeros."""
    if run.start == 0 and run.stop == rows:
        return delta
    before = delta.new_zeros(run.start, per_row, width)
    after = delta.new_zeros(rows - run.stop, per_row, width)
    return torch.cat([before, delta, after])


# Devices where the adapters of a layer take ONE grouped GEMM pair: CUDA, where one kernel runs
# every group. torch's CPU grouped GEMM is one matmul per group anyway, so there the ranks padded
# to the largest and the stacked copies of A and B only add work (mixed ranks 8/16/32:
# benchmarks/packing_profile.py), and each adapter takes its own GEMM pair instead.
GROUPED_DEVICES = frozenset({"cuda"})

# Run the grouped LoRA GEMMs in the base weights' dtype (bf16 on CUDA) instead of the adapters'
# fp32, as the experts do. Off: it fails its numerics gate (benchmarks/numerics_gate.py: its
# logprob error against fp32 exceeds the bf16 base path's own in every family tried).
GROUPED_IN_BASE_DTYPE = False


def contiguous_run(segments: list[Segment]) -> slice | None:
    """The rows the segments cover when they are plain slices back to back (the trainer orders
    rows by adapter), else None."""
    if any(s.index is not None for s in segments):
        return None
    for before, after in itertools.pairwise(segments):
        if before.stop != after.start:
            return None
    return slice(segments[0].start, segments[-1].stop)
