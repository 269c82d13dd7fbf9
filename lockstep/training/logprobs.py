"""Target log-probabilities in token chunks: `[tokens, vocab]` fp32 logits never exist beyond one
chunk, in the forward or in the backward.

`target_logprobs(hidden, targets, head, chunk)` applies the LM head to `chunk` positions at a
time, takes their log-softmax and gathers the targets. With autograd on, each chunk runs under
non-reentrant activation checkpointing: only the chunk's hidden states are kept, and the backward
recomputes one chunk's logits at a time. The numbers are those of the unchunked computation (each
position's log-softmax is its own row), up to GEMM blocking (<= 1e-6 in fp32).

`logprob_fn` turns one chunk of logits into target logprobs: `gather_logprobs` for a full-vocab
head, or a vocab-parallel reduction when the head's output is split over ranks (Megatron).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

Head = Callable[[torch.Tensor], torch.Tensor]  # hidden [c, H] -> logits [c, V] (or a V shard)
LogprobFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # logits, targets [c, K]

CHUNK_LOGIT_ELEMENTS = 1 << 24  # fp32 logits per chunk: 64 MiB


def chunk_tokens(vocab: int, elements: int = CHUNK_LOGIT_ELEMENTS) -> int:
    """Positions per chunk for a vocabulary (at least 8)."""
    return max(8, elements // max(1, vocab))


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax over the (full) vocabulary in fp32, gathered at `targets` [c, K]."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets)


def target_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: Head,
    chunk: int,
    logprob_fn: LogprobFn = gather_logprobs,
) -> torch.Tensor:
    """fp32 logprobs [T, K] of `targets` [T, K] given the final hidden states [T, H]."""

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
