"""The field's kernels for the hybrid layers: flash-linear-attention (`fla`, Triton), called on
the whole packed micro-batch at once, its rows kept apart by `cu_seqlens` (varlen).

Same signatures and semantics as `hybrid_reference` (which checks them, `hybrid_kernels`):
- the gated delta rule: fla's `chunk_gated_delta_rule` (q/k L2-normalised in the kernel, value
  head h reading key head h // (Hv / Hk), as transformers' reference);
- the short convolution: fla's Triton `causal_conv1d` (silu or no activation);
- Mamba-2's scan: fla's `chunk_simple_gla`. Mamba-2's SSD recurrence is simple (scalar-gated)
  linear attention: h_t = exp(g_t) h_{t-1} + k_t^T v_t, y_t = scale q_t h_t with q = C, k = B,
  v = dt x, g = a dt and scale 1, plus the skip d x. fla has no Mamba-2 kernel of its own (its
  Mamba-2 layer calls mamba-ssm, which ships as source only), and its simple-GLA kernel takes
  no grouped heads, so B and C are repeated to the heads first, as transformers' scan does.

Imported only where it can run (a CUDA device); `load()` raises what the import raised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from lockstep.modeling.packing import Packing

ACTIVATIONS = frozenset({None, "silu", "swish"})  # what fla's short convolution computes


class Fla:
    """fla's three kernels, imported once."""

    def __init__(self) -> None:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.simple_gla import chunk_simple_gla

        self.version = _version()
        self._conv: Callable[..., Any] = causal_conv1d
        self._delta: Callable[..., Any] = chunk_gated_delta_rule
        self._gla: Callable[..., Any] = chunk_simple_gla

    def short_convolution(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        activation: str | None,
        rows: Packing,
    ) -> torch.Tensor:
        if activation not in ACTIVATIONS:
            raise ValueError(f"fla's short convolution does not compute {activation!r}")
        y, _ = self._conv(
            x.contiguous(),  # Mamba-2's x | B | C is a slice of its projection: the layout checked
            weight,
            bias,
            activation=activation,
            backend="triton",
            cu_seqlens=rows.cu_seqlens(x.device),
            cu_seqlens_cpu=rows.cu_seqlens_cpu(),
        )
        out: torch.Tensor = y
        return out

    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        rows: Packing,
    ) -> torch.Tensor:
        o, _ = self._delta(
            q,
            k,
            v,
            g,
            beta,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=rows.cu_seqlens(q.device),
            cu_seqlens_cpu=rows.cu_seqlens_cpu(),
        )
        out: torch.Tensor = o
        return out

    def mamba2_scan(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        d: torch.Tensor,
        dt_bias: torch.Tensor,
        dt_limit: tuple[float, float],
        chunk: int,
        rows: Packing,
    ) -> torch.Tensor:
        del chunk  # fla picks its own chunk length; the recurrence is the same
        heads, groups = x.shape[2], b.shape[2]
        dt = F.softplus(dt + dt_bias.to(dt.dtype)).clamp(min=dt_limit[0], max=dt_limit[1])
        q, k = (t.repeat_interleave(heads // groups, dim=2) for t in (c, b))
        v = (x.float() * dt.float()[..., None]).to(x.dtype)
        o, _ = self._gla(
            q,
            k,
            v,
            g=a.float() * dt.float(),
            scale=1.0,
            cu_seqlens=rows.cu_seqlens(x.device),
            cu_seqlens_cpu=rows.cu_seqlens_cpu(),
        )
        out: torch.Tensor = o.float() + d[..., None] * x.float()
        return out


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fla-core")
    except PackageNotFoundError:
        return "unknown"


def load() -> Fla:
    """fla's kernels; raises whatever importing them raises (not installed, no Triton, ...)."""
    return Fla()
