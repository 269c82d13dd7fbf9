"""What one datum's custom loss may cost: a share of the pass it rides on.

A custom loss runs inside the fused training pass, once per datum, while every other tenant of
the cycle waits for that pass. So its cost is bounded relative to the work the datum brings
anyway: its FLOPs (forward and backward of the loss graph) to `FLOPS_SHARE` of the model's
training FLOPs for the datum's tokens, and its peak temporary memory to `MEMORY_SHARE` of the
trainer's memory budget. Tiny models get a floor (`FLOOR_FLOPS_PER_TOKEN`) so ordinary losses
(PPO, importance sampling, DPO, top-K distillation: tens of FLOPs per logprob) still run.

Pure Python (no torch): the scheduler reports the bound (get_info, server capabilities) and
`pricing.py` compares a graph's measured cost with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lockstep.engine.families import ModelConfig
from lockstep.engine.types import MemoryBudget, ModelCard

FLOPS_SHARE = 0.01  # of the model's forward + backward FLOPs for the same datum
FLOOR_FLOPS_PER_TOKEN = 1 << 16  # whatever the model: ~1000 elementwise ops per position
MEMORY_SHARE = 0.02  # of the trainer's memory budget (what one pass may use)
UNLIMITED_MEMORY_BYTES = 256 << 20  # the memory bound when the trainer reports no budget


def model_flops_per_token(config: dict[str, Any]) -> int:
    """A LoRA training pass's FLOPs per token, from a HF text config: 2 per active weight in
    the forward and 2 more in the backward (activation gradients only: the base is frozen).
    Attention scores (which grow with the row's length) are left out: the bound errs low."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    width = int(config.get("intermediate_size") or 4 * hidden)
    if config.get("moe_intermediate_size") and config.get("num_experts_per_tok"):
        experts = int(config["num_experts_per_tok"]) + int(config.get("n_shared_experts") or 0)
        width = int(config["moe_intermediate_size"]) * experts + int(
            config.get("shared_expert_intermediate_size") or 0
        )
    attention = 2 * hidden * head_dim * (heads + kv_heads)  # q, o; k, v
    mlp = 3 * hidden * width  # gate, up, down
    weights = int(config["num_hidden_layers"]) * (attention + mlp)
    weights += hidden * int(config["vocab_size"])  # the LM head
    return 4 * weights


@dataclass(frozen=True)
class CostBound:
    """The most one datum's custom loss may cost: `flops_per_token` x the datum's tokens, and
    `memory_bytes` of temporaries at its peak."""

    flops_per_token: int
    memory_bytes: int

    def flops(self, tokens: int) -> int:
        return self.flops_per_token * max(tokens, 1)

    @classmethod
    def of(cls, model_flops: int, budget: MemoryBudget) -> CostBound:
        """From the model's training FLOPs per token (0: unknown) and the trainer's budget."""
        flops = max(int(model_flops * FLOPS_SHARE), FLOOR_FLOPS_PER_TOKEN)
        room = int(budget.budget_bytes * MEMORY_SHARE) if budget.budget_bytes else 0
        return cls(flops, room or UNLIMITED_MEMORY_BYTES)

    @classmethod
    def for_model(cls, card: ModelCard, budget: MemoryBudget) -> CostBound:
        """The bound for the served model: its config.json read once (a model directory
        without a readable config gets the floor)."""
        try:
            flops = model_flops_per_token(ModelConfig.read(card.directory).text)
        except (OSError, ValueError, KeyError, TypeError):
            flops = 0
        return cls.of(flops, budget)

    def describe(self) -> str:
        return (
            f"{self.flops_per_token} FLOPs per token of the datum and "
            f"{self.memory_bytes / (1 << 20):.0f} MiB of temporaries"
        )
