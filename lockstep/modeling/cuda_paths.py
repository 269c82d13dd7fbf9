"""The code paths a CUDA device takes, chosen on a CPU: for the op census (`op_census.py`), which
counts what a GPU cycle launches on a machine without one.

`cuda_paths()` sets, for its duration:
- the linear LoRA's grouped GEMM pair over every adapter (`linear_lora.GROUPED_DEVICES`);
- CUDA's group limit on the CPU's grouped GEMM (`grouped_gemm.GROUP_LIMITS`);
- with `varlen`, row attention's VARLEN path (one varlen call per packed sequence where the
  layer allows it, `attention.varlen_takes`) through a STAND-IN kernel: torch's varlen kernel is
  CUDA-only, so `lockstep_census::varlen_attn` (and its backward) compute the same attention one
  sequence at a time, as one custom op each, which the census sees as the one kernel call CUDA
  makes. Its numbers are the math kernel's (causal, optional window, grouped K/V heads).
The base weights' dtype (bf16 on CUDA) is the engine's own setting (`dtype="bfloat16"`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lockstep.modeling import attention, grouped_gemm, linear_lora


@contextmanager
def cuda_paths(varlen: bool = True) -> Iterator[dict[str, Any]]:
    """Choose CUDA's code paths on the CPU (module docstring); yields what was chosen."""
    saved = (
        linear_lora.GROUPED_DEVICES,
        dict(grouped_gemm.GROUP_LIMITS),
        attention.VARLEN,
        attention.VARLEN_DEVICES,
        attention._VARLEN_KERNEL,
        attention._VARLEN_PARAMS,
    )
    linear_lora.GROUPED_DEVICES = linear_lora.GROUPED_DEVICES | {"cpu"}
    grouped_gemm.GROUP_LIMITS["cpu"] = grouped_gemm.GROUP_LIMITS["cuda"]
    if varlen:
        attention.VARLEN = True
        attention.VARLEN_DEVICES = attention.VARLEN_DEVICES | {"cpu"}
        attention._VARLEN_KERNEL = stand_in_varlen_attn
        attention._VARLEN_PARAMS = frozenset({"scale", "window_size", "enable_gqa"})
    try:
        yield {
            "linear_lora_grouped_devices": sorted(linear_lora.GROUPED_DEVICES),
            "lora_gemms_in_base_dtype": linear_lora.GROUPED_IN_BASE_DTYPE,
            "group_limit": grouped_gemm.GROUP_LIMITS["cpu"],
            "varlen_attention": varlen,
        }
    finally:
        (
            linear_lora.GROUPED_DEVICES,
            limits,
            attention.VARLEN,
            attention.VARLEN_DEVICES,
            attention._VARLEN_KERNEL,
            attention._VARLEN_PARAMS,
        ) = saved
        grouped_gemm.GROUP_LIMITS.clear()
        grouped_gemm.GROUP_LIMITS.update(limits)


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
    """torch's `varlen_attn` contract ([T, H, D] in and out; causal as window_size (left, 0)),
    computed by the stand-in op."""
    if window_size[1] != 0:
        raise ValueError("the stand-in computes causal attention only (window_size (left, 0))")
    scaling = q.shape[-1] ** -0.5 if scale is None else scale
    out: torch.Tensor = torch.ops.lockstep_census.varlen_attn(
        q, k, v, cu_q, scaling, window_size[0]
    )
    return out


def _probabilities(q: torch.Tensor, k: torch.Tensor, scale: float, left: int) -> torch.Tensor:
    """Softmax of one sequence's causal (windowed: keys at most `left` back) scores, fp32,
    [H, L, L]; q [L, H, D], k [L, H, D] (K heads already repeated to Q's)."""
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    at = torch.arange(q.shape[0])
    mask = at[None, :] <= at[:, None]
    if left >= 0:
        mask &= at[None, :] >= at[:, None] - left
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)


def _sequences(cu: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu.tolist()
    return list(zip(bounds, bounds[1:], strict=False))


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


@torch.library.custom_op("lockstep_census::varlen_attn", mutates_args=())
def _varlen_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float, left: int
) -> torch.Tensor:
    out = torch.empty_like(q)
    for start, stop in _sequences(cu):
        kk, vv = (_heads(t[start:stop], q.shape[1]) for t in (k, v))
        p = _probabilities(q[start:stop], kk, scale, left)
        out[start:stop] = torch.einsum("hqk,khd->qhd", p, vv.float()).to(q.dtype)
    return out


@torch.library.custom_op("lockstep_census::varlen_attn_backward", mutates_args=())
def _varlen_attn_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    scale: float,
    left: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
    heads, groups = q.shape[1], q.shape[1] // k.shape[1]
    for start, stop in _sequences(cu):
        span = slice(start, stop)
        kk, vv = (_heads(t[span], heads).float() for t in (k, v))
        p = _probabilities(q[span], kk, scale, left)  # [H, L, L]
        g = grad[span].float()
        dv_rep = torch.einsum("hqk,qhd->khd", p, g)
        dp = torch.einsum("qhd,khd->hqk", g, vv)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
        dq[span] = torch.einsum("hqk,khd->qhd", ds, kk)
        dk_rep = torch.einsum("hqk,qhd->khd", ds, q[span].float())
        length = stop - start
        dk[span] = dk_rep.view(length, -1, groups, dk_rep.shape[-1]).sum(2)
        dv[span] = dv_rep.view(length, -1, groups, dv_rep.shape[-1]).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, cu, scale, left = inputs
    ctx.save_for_backward(q, k, v, cu)
    ctx.scale, ctx.left = scale, left


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    q, k, v, cu = ctx.saved_tensors
    dq, dk, dv = torch.ops.lockstep_census.varlen_attn_backward(
        grad, q, k, v, cu, ctx.scale, ctx.left
    )
    return dq, dk, dv, None, None, None


_varlen_attn.register_autograd(_backward, setup_context=_setup)
