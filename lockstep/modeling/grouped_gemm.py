"""Grouped GEMMs: rows in runs, one weight per run, one kernel call (`torch._grouped_mm`).

The experts' base projections (a group per expert), their LoRA (a group per adapter and expert)
and the linear layers' grouped LoRA (a group per adapter) all go through `grouped_mm`. Backends
limit how many groups one call takes (CUDA: 1024, measured on an H200 with torch 2.11; the CPU
kernel has no limit): a call with more is cut into runs of whole groups under the limit, each
its own kernel call, so any K tenants x E experts run. Each group's product is computed alone in
either case, so the cut changes no number. A caller that knows where its cuts fall in rows
(`Cuts`) hands them in; otherwise the rows are read from the device once per call.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

# Use torch's grouped GEMM kernel where it takes the operands (False: one matmul per group;
# benchmarks/moe_gpu.py compares the two).
GROUPED_KERNEL = True
# The most groups one kernel call takes, per device type (absent: no limit). Tests set a limit
# on the CPU, with the kernel wrapped to refuse more, to show every path cuts under it.
GROUP_LIMITS: dict[str, int] = {"cuda": 1024}

# Where a call's groups are cut: (first group, first row) of every run after the first.
Cuts = Sequence[tuple[int, int]]


def group_limit(device: torch.device) -> int | None:
    """The most groups one grouped GEMM call takes on `device` (None: any number)."""
    return GROUP_LIMITS.get(device.type)


def group_ends(sorted_groups: torch.Tensor, groups: int) -> torch.Tensor:
    """int32 end offset of each group's run in a sorted group index (empty groups included).
    A search of the sorted index, not a count: its size is known without reading the index
    (CUDA's bincount reads its maximum back), so it can run inside a captured CUDA graph."""
    bounds = torch.arange(groups, device=sorted_groups.device, dtype=sorted_groups.dtype)
    return torch.searchsorted(sorted_groups, bounds, right=True).to(torch.int32)


def grouped_mm(
    x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, cuts: Cuts | None = None
) -> torch.Tensor:
    """x [m, k] in runs of rows (group g: rows ends[g-1]..ends[g]-1) @ w [G, k, n] -> [m, n].

    torch's grouped GEMM kernel where it takes the operands (16-byte aligned strides; CUDA
    needs sm80+), in runs of at most the device's group limit (`cuts`: where they start, when
    the caller knows; each run at most the limit), else one matmul per non-empty group."""
    if not (GROUPED_KERNEL and _kernel_takes(x, w)):
        return _per_group(x, w, ends)
    limit = group_limit(x.device)
    if limit is None or w.shape[0] <= limit:
        return _kernel(x, w, ends)
    runs = [(0, 0), *(cuts if cuts is not None else _cuts_every(limit, ends))]
    runs.append((w.shape[0], x.shape[0]))
    parts = []
    for (g0, r0), (g1, r1) in itertools.pairwise(runs):
        assert g1 - g0 <= limit, (g0, g1, limit)
        if r1 > r0:
            offs = ends[g0:g1] - r0 if r0 else ends[g0:g1]
            parts.append(_kernel(x[r0:r1], w[g0:g1], offs))
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


def cuts_between(groups_per_part: int, part_rows: Sequence[int], limit: int | None) -> Cuts | None:
    """Cuts of a call whose groups come in parts of `groups_per_part` (an adapter's experts)
    holding `part_rows` rows each (known on the host): as many whole parts per run as the limit
    takes. None when all groups fit one call, or when a part alone exceeds the limit (then
    `grouped_mm` reads its cuts from the device)."""
    parts = len(part_rows)
    if limit is None or parts * groups_per_part <= limit or groups_per_part > limit:
        return None
    per_run = limit // groups_per_part
    cuts, row = [], 0
    for part, rows in enumerate(part_rows):
        if part and part % per_run == 0:
            cuts.append((part * groups_per_part, row))
        row += rows
    return cuts


def _cuts_every(limit: int, ends: torch.Tensor) -> Cuts:
    """A cut every `limit` groups, its first row read from the device (one sync)."""
    marks = list(range(limit, ends.shape[0], limit))
    rows = ends[torch.tensor(marks, device=ends.device) - 1].tolist()
    return list(zip(marks, rows, strict=True))


def _kernel(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    y = torch._grouped_mm(x, w, offs=ends)
    # Its backward needs the same strides of the gradient; a part of a fused gate|up has not.
    if y.requires_grad:
        y.register_hook(torch.Tensor.contiguous)  # type: ignore[no-untyped-call]
    return y


def _per_group(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    parts, start = [], 0
    for g, end in enumerate(ends.tolist()):
        if end > start:
            parts.append(x[start:end] @ w[g])
        start = end
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


def _kernel_takes(*operands: torch.Tensor) -> bool:
    if operands[0].is_cuda and torch.cuda.get_device_capability(operands[0].device) < (8, 0):
        return False
    for t in operands:
        if t.data_ptr() % 16 or t.dtype != operands[0].dtype:
            return False
        for size, stride in zip(t.shape, t.stride(), strict=True):
            if size > 1 and stride != 1 and (stride * t.element_size()) % 16:
                return False
    return True


def lora_stack(
    adapters: Sequence[tuple[torch.Tensor, torch.Tensor] | None], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adapters' A [(E,) r_i, in] and B [(E,) out, r_i] as A [G, r, in] and B [G, out, r] in
    `dtype` for one grouped GEMM pair: one group per expert of each adapter (one per 2-D
    adapter), in order. Ranks are zero-padded to the largest, rounded up to whole 16-byte rows
    (what the grouped kernel needs of every operand); exact: padded rank rows and columns add
    zeros. None: an adapter that does not train it, all zeros (its groups add exact zeros).
    Autograd reaches each adapter's own tensors and nothing else.

    The same number of kernels whatever the number of adapters (`_Stack`): one copy-and-cast
    of every adapter into the stack, one cast of the stack's gradient back."""
    real = [w for w in adapters if w is not None]
    a0, b0 = real[0]
    align = 16 // dtype.itemsize
    rank = -(-max(a.shape[-2] for a, _ in real) // align) * align
    if len(adapters) == 1 and rank == a0.shape[-2]:  # one adapter, unpadded: its own tensors
        return a0.to(dtype).reshape(-1, *a0.shape[-2:]), b0.to(dtype).reshape(-1, *b0.shape[-2:])
    ranks = [None if w is None else w[0].shape[-2] for w in adapters]
    stack = cast(Callable[..., torch.Tensor], _Stack.apply)  # torch leaves it untyped
    a = stack(ranks, rank, -2, dtype, *(a for a, _ in real))
    b = stack(ranks, rank, -1, dtype, *(b for _, b in real))
    return a, b


class _Stack(torch.autograd.Function):
    """Adapters' tensors [(E,) ..] (rank along `axis`) stacked into [K * E, .., rank, ..] in
    `dtype`: ONE `_foreach_copy_` writes (and casts) every adapter into its slot, where a
    `torch.cat` of per-adapter casts and pads took a cast and a pad per adapter; its backward
    is ONE cast of the stack's gradient, each adapter's gradient a view of its slot. Exact: the
    same casts of the same values as the per-adapter path.

    On CUDA the copy is one multi-tensor kernel when the slots match the adapters' strides
    (every adapter at the stack's rank); padded slots take one copy per adapter."""

    @staticmethod
    def forward(
        ctx: Any,
        ranks: list[int | None],
        rank: int,
        axis: int,
        dtype: torch.dtype,
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        first = weights[0]
        tail = list(first.shape[-2:])
        tail[axis] = rank
        padded = any(r != rank for r in ranks)
        make = first.new_zeros if padded else first.new_empty
        out = make(len(ranks), *first.shape[:-2], *tail, dtype=dtype)
        torch._foreach_copy_(_slots(out, ranks, axis), list(weights))
        ctx.ranks, ctx.axis, ctx.dtype, ctx.lead = ranks, axis, first.dtype, first.shape[:-2]
        return out.view(-1, *tail)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Contiguous: each adapter's gradient then has its parameter's layout, which autograd
        # keeps as it is (a strided one it would copy, once per adapter).
        whole = grad.to(ctx.dtype, memory_format=torch.contiguous_format)
        whole = whole.view(len(ctx.ranks), *ctx.lead, *grad.shape[-2:])
        return (None, None, None, None, *_slots(whole, ctx.ranks, ctx.axis))


def _slots(stack: torch.Tensor, ranks: list[int | None], axis: int) -> list[torch.Tensor]:
    """Each present adapter's slot [(E,) .., r_i, ..] of a stack [K, (E,) .., rank, ..]: one
    view op where no slot is padded (torch's unbind), a narrowed view per padded slot."""
    slots = stack.unbind(0)
    return [
        s if r == s.shape[axis] else s.narrow(axis, 0, r)
        for s, r in zip(slots, ranks, strict=True)
        if r is not None
    ]
