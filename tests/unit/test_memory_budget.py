"""The pass-cost arithmetic of lockstep/engine/memory.py, on the tiny model's shape and a
Qwen3-8B-shaped one (no model is loaded)."""

from __future__ import annotations

import pytest

from lockstep.engine import memory
from lockstep.engine.shape import (
    AttentionShape,
    FeedForwardShape,
    LayerShape,
    Mixer,
    ModelShape,
    TrainerPath,
)


def dense(hidden: int, width: int, layers: int, heads: int, kv: int, head_dim: int, vocab: int):
    att = AttentionShape(heads=heads, kv_heads=kv, head_dim=head_dim, value_head_dim=head_dim)
    layer = LayerShape(Mixer.ATTENTION, attention=att, ffn=FeedForwardShape(width, gated=True))
    return ModelShape("qwen3", hidden, vocab, (layer,) * layers, TrainerPath.PACKED)


TINY = dense(128, 256, 2, 4, 2, 64, 1024)
QWEN3_8B = dense(4096, 12288, 36, 32, 8, 128, 151936)


def _cost(
    shape: ModelShape, e: int = 4, ckpt: bool = False, scored: bool = False
) -> memory.PassCost:
    chunk = (1 << 26) // shape.vocab  # what the local engine takes on a GPU
    return memory.PassCost.from_shape(shape, e, ckpt, 1024, chunk, scored)


def test_the_longest_row_that_fits_is_the_last_one_under_the_budget() -> None:
    cost = _cost(TINY, scored=True)
    budget = cost.pass_bytes(3000)
    found = cost.budget(budget, 4096, "test")
    assert found.max_row_tokens == 3000
    assert cost.pass_bytes(3000) <= budget < cost.pass_bytes(3001)
    assert cost.budget(10 * budget, 4096, "test").max_row_tokens == 4096  # the context caps it
    with pytest.raises(ValueError, match="--micro-batch-tokens"):
        cost.budget(cost.pass_bytes(1) - 1, 4096, "test")


def test_checkpointing_bf16_and_fused_attention_cost_what_they_should() -> None:
    full, ckpt = _cost(QWEN3_8B, 2), _cost(QWEN3_8B, 2, ckpt=True)
    assert ckpt.per_token < full.per_token / 5  # layer inputs instead of every activation
    assert _cost(QWEN3_8B, 2, scored=True).pass_bytes(8192) > full.pass_bytes(8192)
    assert full.scores_per_token_sq == 0  # fused causal SDPA keeps no scores
    # Not absurd: ~0.26 MB per layer and token in bf16 (0.12 MB base activations, 0.15 MB of
    # inputs cast to fp32 for the adapters); checkpointed, an 8k-token row needs a few GB.
    assert 0.2e6 < full.per_token / 36 < 0.35e6
    assert 3 * memory.GIB < ckpt.pass_bytes(8192) < 20 * memory.GIB


def test_budgets_from_flag_device_and_host() -> None:
    assert memory.cpu_budget(5 * memory.GIB) == (5 * memory.GIB, "--trainer-memory-budget")
    budget, source = memory.cpu_budget(0)
    assert 0 < budget <= memory.available_ram() and "%" in source
    budget, source = memory.cuda_budget(60 * memory.GIB, 80 * memory.GIB, 0)
    assert budget == 52 * memory.GIB and "free device memory" in source


def test_auto_checkpointing_recomputes_the_fewest_layers_that_fit() -> None:
    cost = _cost(QWEN3_8B, 2, ckpt=True)
    kept = cost.micro_batch_bytes(8192, 8192)
    every = cost.micro_batch_bytes(8192, 8192, range(36))
    assert cost.pass_bytes(8192) == every  # admission counts every layer recomputed
    assert cost.checkpoint_plan(8192, 8192, kept) == ()  # it fits: nothing recomputed
    for budget in (every, (kept + every) // 2, kept - 1):
        plan = cost.checkpoint_plan(8192, 8192, budget)
        assert cost.micro_batch_bytes(8192, 8192, plan) <= budget
        assert plan == tuple(range(len(plan)))  # equal layers: the earliest first
        fewer = plan[:-1]
        assert cost.micro_batch_bytes(8192, 8192, fewer) > budget  # one fewer would not fit
    assert 0 < len(cost.checkpoint_plan(8192, 8192, (kept + every) // 2)) < 36
