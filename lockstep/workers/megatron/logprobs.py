"""Vocab-parallel target logprobs on the last pipeline stage: each TP rank keeps its vocabulary
shard of the logits (`parallel_output=True`); max, sum of exponentials and the target logit are
all-reduced over TP (a few floats per position), never the vocabulary itself.

Plugs into `lockstep.training.logprobs.target_logprobs` as its `logprob_fn`, so positions go in
the same chunks as the local engine's. The all-reduces of sums use megatron's
`reduce_from_tensor_model_parallel_region` (identity backward): every rank computes the same
loss from the reduced values, so each rank's shard gets exactly its part of the gradient.
"""

from __future__ import annotations

import torch


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fp32 logprobs [c, K] of global token ids `targets` [c, K] from this rank's shard
    [c, V / tp] of the logits (shards in TP-rank order)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    logits = logits.float()
    shard = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * shard
    peak = logits.detach().amax(dim=-1, keepdim=True)  # a constant shift: no gradient
    torch.distributed.all_reduce(
        peak, op=torch.distributed.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group()
    )
    shifted = logits - peak
    sum_exp = reduce_from_tensor_model_parallel_region(shifted.exp().sum(-1, keepdim=True))
    local = targets - start
    inside = (local >= 0) & (local < shard)
    picked = shifted.gather(-1, local.clamp(0, shard - 1)) * inside
    out: torch.Tensor = reduce_from_tensor_model_parallel_region(picked) - sum_exp.log()
    return out
