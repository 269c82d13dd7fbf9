"""Row attention's VARLEN path (one varlen call for every row of a packed sequence) against the
per-row loop. torch's varlen kernel is CUDA-only: on CPU its plumbing (row blocks as sequences,
windows, grouped K/V heads) runs through a stand-in kernel built from per-sequence SDPA, named
as such; on CUDA the real kernel is compared in bf16."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lockstep.modeling import attention
from lockstep.modeling.packing import Packing, packed_rows

LENGTHS = [37, 100, 8, 64]


def _layout() -> Packing:
    widths = [-(-n // 8) * 8 for n in LENGTHS]
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return Packing(tuple(starts), tuple(LENGTHS), tuple(widths))


def _qkv(layout: Packing, dtype: torch.dtype, device: str, dim_v: int = 32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    total = sum(layout.widths)
    shapes = [(1, 8, total, 32), (1, 2, total, 32), (1, 2, total, dim_v)]  # grouped K/V heads
    return [torch.randn(s, generator=gen).to(device, dtype).requires_grad_() for s in shapes]


def stand_in_varlen_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
) -> torch.Tensor:
    """A CPU stand-in for torch's varlen kernel (same contract, [T, H, D] in and out), one SDPA
    per sequence with an explicit mask."""
    assert window_size[1] == 0, "the trainer only asks for causal attention"
    outs = []
    bounds = cu_q.tolist()
    for start, stop in zip(bounds, bounds[1:], strict=False):
        qs, ks, vs = (t[start:stop].transpose(0, 1)[None] for t in (q, k, v))
        at = torch.arange(stop - start)
        mask = at[None, :] <= at[:, None]
        if window_size[0] >= 0:
            mask &= at[None, :] >= at[:, None] - window_size[0]
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("dim_v", [32, 16], ids=["one-head-dim", "mla-value-head-16"])
@pytest.mark.parametrize("window", [None, 16], ids=["causal", "window16"])
def test_varlen_plumbing_equals_the_row_loop(
    monkeypatch: pytest.MonkeyPatch, window: int | None, dim_v: int
) -> None:
    layout = _layout()
    monkeypatch.setattr(attention, "_VARLEN_KERNEL", stand_in_varlen_attn)
    monkeypatch.setattr(
        attention, "_VARLEN_PARAMS", frozenset({"scale", "window_size", "enable_gqa"})
    )
    outs, grads = [], []
    for varlen in (False, True):
        q, k, v = _qkv(layout, torch.float32, "cpu", dim_v)
        if varlen:
            out = attention._varlen(q, k, v, layout, 0.2, window)
        else:
            with packed_rows(layout.starts, layout.lengths, layout.widths):
                out, _ = attention.row_attention_forward(
                    torch.nn.Identity(), q, k, v, None, scaling=0.2, sliding_window=window
                )
        real = torch.cat([out[0, s : s + n] for s, n in layout.spans()])
        real.square().sum().backward()
        outs.append(real)
        grads.append([t.grad for t in (q, k, v)])
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-5)
    for a, b in zip(grads[1], grads[0], strict=True):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


CUDA_VARLEN = pytest.mark.skipif(
    not torch.cuda.is_available() or attention._VARLEN_KERNEL is None,
    reason="torch's varlen attention runs on CUDA only",
)


def test_varlen_leaves_cpu_and_fp32_to_the_row_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "VARLEN", True)
    q = torch.zeros(1, 4, 8, 16)
    assert not attention.varlen_takes(q, q, None, None)  # CPU, fp32
    half = q.bfloat16()
    assert not attention.varlen_takes(half, half, None, None)  # CPU, even in bf16


@CUDA_VARLEN
def test_varlen_refuses_what_it_cannot_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "VARLEN", True)
    half = torch.zeros(1, 4, 8, 16, device="cuda", dtype=torch.bfloat16)
    assert not attention.varlen_takes(half.float(), half.float(), None, None)  # fp32
    assert attention.varlen_takes(half, half, None, None)
    assert not attention.varlen_takes(half, half, None, torch.zeros(4, device="cuda"))  # sinks
    assert attention.varlen_takes(half, half[..., :8], None, None)  # MLA: V padded to Dqk
    assert not attention.varlen_takes(half[..., :8], half, None, None)  # V wider than Q/K
    monkeypatch.setattr(attention, "VARLEN", False)
    assert not attention.varlen_takes(half, half, None, None)


@CUDA_VARLEN
@pytest.mark.parametrize("window", [None, 16], ids=["causal", "window16"])
def test_varlen_kernel_equals_the_row_loop_on_cuda(
    monkeypatch: pytest.MonkeyPatch, window: int | None
) -> None:
    layout = _layout()
    outs: list[Any] = []
    for varlen in (False, True):
        monkeypatch.setattr(attention, "VARLEN", varlen)
        q, k, v = _qkv(layout, torch.bfloat16, "cuda")
        with packed_rows(layout.starts, layout.lengths, layout.widths):
            out, _ = attention.row_attention_forward(
                torch.nn.Identity(), q, k, v, None, scaling=0.2, sliding_window=window
            )
        real = torch.cat([out[0, s : s + n] for s, n in layout.spans()]).float()
        real.square().sum().backward()
        outs.append((real, [t.grad.float() for t in (q, k, v) if t.grad is not None]))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=2e-2, atol=2e-2)
    for a, b in zip(outs[1][1], outs[0][1], strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)
