"""Target log-probabilities in token chunks: `[tokens, vocab]` fp32 logits never exist beyond one
chunk, in the forward or in the backward.

Two paths, the same numbers (each position's log-softmax is its own row; up to GEMM blocking,
<= 1e-6 in fp32):

- FUSED (`LinearHead`: the head given by its parts, weight, bias and the row's LoRA): one
  autograd function over every chunk (`_FusedHeadLogprobs`). The forward computes a chunk's
  logits, gathers the targets and keeps only each position's logsumexp; the backward recomputes
  a chunk's logits once and forms the gradient itself, (onehot - softmax) scaled by the upstream
  gradient, for the hidden states and the head's LoRA, the way fused linear-cross-entropy
  kernels do. Without a LoRA on the head and with one target per position (1-D targets), the
  forward already forms `(onehot - softmax) @ W` per position ([T, H], the size of the hidden
  states), so the backward is one scale and the logits are computed once in all (two vocabulary
  GEMMs per chunk instead of three).
- CHUNKED (any `Head` callable, any `logprob_fn`: Megatron's vocab-parallel reduction): each
  chunk's head and log-softmax under non-reentrant activation checkpointing; autograd's own
  backward of log_softmax and gather.

`logprob_fn` turns one chunk of logits into target logprobs: `gather_logprobs` for a full-vocab
head, or a vocab-parallel reduction when the head's output is split over ranks (Megatron).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

Head = Callable[[torch.Tensor], torch.Tensor]  # hidden [c, H] -> logits [c, V] (or a V shard)
LogprobFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # logits, targets [c, K]

CHUNK_LOGIT_ELEMENTS = 1 << 24  # fp32 logits per chunk: 64 MiB
# The fused path for `LinearHead`s (False: the chunked, checkpointed path; the benchmarks compare).
FUSED_HEAD = True


def chunk_tokens(vocab: int, elements: int = CHUNK_LOGIT_ELEMENTS) -> int:
    """Positions per chunk for a vocabulary (at least 8)."""
    return max(8, elements // max(1, vocab))


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax over the (full) vocabulary in fp32, gathered at `targets` [c, K]."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets)


@dataclass(frozen=True)
class LinearHead:
    """An LM head by its parts: `hidden @ weight.T (+ bias)`, plus `scale * (hidden @ A.T) @ B.T`
    when the row's adapter trains the head (A [r, H], B [V, r], fp32), computed as
    `modeling.lora.MultiLoRALinear` computes it. Called, it is that layer's forward."""

    weight: torch.Tensor  # [V, H], frozen
    bias: torch.Tensor | None = None
    lora: tuple[torch.Tensor, torch.Tensor, float] | None = None  # (A, B, scale)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        y = F.linear(hidden, self.weight, self.bias)
        if self.lora is None:
            return y
        a, b, scale = self.lora
        return y + (((hidden.to(a.dtype) @ a.t()) * scale) @ b.t()).to(y.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [c, V] of hidden states [c, H] (the LoRA term added in fp32)."""
        y = F.linear(hidden, self.weight, self.bias).float()
        if self.lora is not None:
            a, b, scale = self.lora
            y.addmm_((hidden.to(a.dtype) @ a.t()) * scale, b.t())
        return y

    def trains_base(self) -> bool:
        return self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)


def target_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Head | LinearHead,
    chunk: int,
    logprob_fn: LogprobFn = gather_logprobs,
) -> torch.Tensor:
    """fp32 logprobs [T, K] of `targets` [T, K] given the final hidden states [T, H]."""
    if isinstance(head, LinearHead) and FUSED_HEAD and logprob_fn is gather_logprobs:
        if not head.trains_base():  # a frozen base head: the fused function's contract
            return fused_target_logprobs(hidden, targets, head, chunk)

    def one(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return logprob_fn(head(h), t)

    pieces = []
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        if torch.is_grad_enabled():
            pieces.append(checkpoint(one, h, t, use_reentrant=False))
        else:
            pieces.append(one(h, t))
    return torch.cat(pieces) if len(pieces) != 1 else pieces[0]


def fused_target_logprobs(
    hidden: torch.Tensor, targets: torch.Tensor, head: LinearHead, chunk: int
) -> torch.Tensor:
    """fp32 logprobs [T, K] of `targets` [T, K] through a frozen `LinearHead` (module docstring:
    the FUSED path). Differentiable in `hidden` and the head's LoRA A / B."""
    lora = head.lora
    tracked = [hidden] + ([] if lora is None else [lora[0], lora[1]])
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tracked)):
        with torch.no_grad():
            return torch.cat(
                [
                    _chunk_logprobs(head, h, t)[0]
                    for h, t in zip(
                        torch.split(hidden, chunk), torch.split(targets, chunk), strict=True
                    )
                ]
            )
    a, b, scale = (None, None, 0.0) if lora is None else lora
    fused = cast(Callable[..., torch.Tensor], _FusedHeadLogprobs.apply)  # torch leaves it untyped
    return fused(hidden, targets, head.weight, head.bias, a, b, scale, chunk)


def _chunk_logprobs(
    head: LinearHead, h: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target logprobs [c, K], logsumexp [c], the chunk's fp32 logits [c, V])."""
    logits = head.logits(h)
    lse = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, t) - lse.unsqueeze(-1), lse, logits


class _FusedHeadLogprobs(torch.autograd.Function):
    """hidden [T, H], targets [T, K] -> target logprobs [T, K] (module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora_a: torch.Tensor | None,
        lora_b: torch.Tensor | None,
        scale: float,
        chunk: int,
    ) -> torch.Tensor:
        lora = None if lora_a is None or lora_b is None else (lora_a, lora_b, scale)
        head = LinearHead(weight, bias, lora)
        # No LoRA on the head and one target per position: the gradient of a position's hidden
        # state is its upstream gradient times (onehot - softmax) @ W, formed here.
        direct = lora is None and targets.shape[1] == 1
        outs, lses, slopes = [], [], []
        for h, t in zip(torch.split(hidden, chunk), torch.split(targets, chunk), strict=True):
            out, lse, logits = _chunk_logprobs(head, h, t)
            outs.append(out)
            lses.append(lse)
            if direct:
                dlogits = logits.sub_(lse.unsqueeze(-1)).exp_().neg_()  # -softmax, in place
                dlogits.scatter_add_(-1, t, dlogits.new_ones(t.shape))
                slopes.append(dlogits.to(weight.dtype) @ weight)
            del logits
        ctx.direct = direct
        ctx.hidden_dtype = hidden.dtype
        ctx.scale = scale
        ctx.chunk = chunk
        if direct:
            ctx.save_for_backward(torch.cat(slopes))
        else:
            ctx.save_for_backward(hidden, targets, weight, bias, lora_a, lora_b, torch.cat(lses))
        return torch.cat(outs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.direct:
            (slope,) = ctx.saved_tensors
            dh = (grad.to(torch.float32) * slope.float()).to(ctx.hidden_dtype)
            return dh, None, None, None, None, None, None, None
        hidden, targets, weight, bias, lora_a, lora_b, lse = ctx.saved_tensors
        lora = None if lora_a is None else (lora_a, lora_b, ctx.scale)
        head = LinearHead(weight, bias, lora)
        want_h, want_a, want_b = (ctx.needs_input_grad[i] for i in (0, 4, 5))
        dh = torch.empty_like(hidden) if want_h else None
        da = torch.zeros_like(lora_a) if want_a else None
        db = torch.zeros_like(lora_b) if want_b else None
        at = 0
        grad = grad.to(torch.float32)
        for h, t, g, s in zip(
            torch.split(hidden, ctx.chunk),
            torch.split(targets, ctx.chunk),
            torch.split(grad, ctx.chunk),
            torch.split(lse, ctx.chunk),
            strict=True,
        ):
            # d logprob[t_k] / d logits = onehot(t_k) - softmax; scaled by the upstream grad:
            # dlogits = scatter(g) - sum_k(g_k) * softmax, formed in place of the logits.
            dlogits = head.logits(h).sub_(s.unsqueeze(-1)).exp_()
            dlogits.mul_(-g.sum(-1, keepdim=True)).scatter_add_(-1, t, g)
            if dh is not None:
                dh[at : at + h.shape[0]] = _hidden_grad(dlogits, h, head, da, db)
            elif da is not None or db is not None:
                _hidden_grad(dlogits, h, head, da, db)
            at += h.shape[0]
        return dh, None, None, None, da, db, None, None


def _hidden_grad(
    dlogits: torch.Tensor,
    h: torch.Tensor,
    head: LinearHead,
    da: torch.Tensor | None,
    db: torch.Tensor | None,
) -> torch.Tensor:
    """A chunk's gradient of its hidden states from d logits [c, V] (fp32); accumulates the
    head LoRA's gradients into `da` [r, H] / `db` [V, r] on the way."""
    weight = head.weight
    dh = dlogits.to(weight.dtype) @ weight
    if head.lora is None:
        return dh
    a, b, scale = head.lora
    x = h.to(a.dtype)
    if db is not None:  # delta = (x A^T s) B^T: dB = dlogits^T (x A^T s)
        db.addmm_(dlogits.t(), (x @ a.t()) * scale)
    du = (dlogits @ b) * scale  # [c, r]
    if da is not None:
        da.addmm_(du.t(), x)
    return dh + (du @ a).to(dh.dtype)
