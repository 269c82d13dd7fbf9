"""What a training pass costs in memory, from the model config, and how much memory there is.

Pure Python (no torch): the engines compute their `MemoryBudget` with it at start-up and the
tests check the arithmetic without a model. The scheduler only sees the resulting budget.
"""

from __future__ import annotations

import json
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockstep.engine.types import MemoryBudget

GIB = 1 << 30
CPU_SHARE = 0.75  # of the memory the trainer could still take: the rest for everything else
CUDA_MARGIN = 0.10  # of the device's total memory, kept free beside a pass (allocator, tenants)


def text_config(model_dir: Path) -> dict[str, Any]:
    """The language model's settings in a HF `config.json` (multimodal: its `text_config`)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text: dict[str, Any] = config.get("text_config") or config
    return text


@dataclass(frozen=True)
class PassCost:
    """Bytes one micro-batch of a fused pass holds, for a batch whose longest row has T tokens:

        bytes(T) = per_token * max(T, batch_tokens) + scores_per_token_sq * T^2 + fixed

    per_token, e the base dtype's bytes, LoRA inputs cast to fp32 (4 bytes) where e < 4:
      layer = e * (4H + 4I + d * (7 heads + 4 kv_heads)) + 4 * (5H + heads * d + I) [if e < 4]
      no checkpointing: (layers + 1) * layer + e * H   (every layer kept, + backward's working set)
      checkpointing:    layers * e * H + 2 * layer     (layer inputs, + one recomputed layer)
    (I: the MLP width a token passes, top-k experts and shared experts for MoE; MoE layers add
    e * k * (5H + 9 I_expert) for each token's k (token, expert) pairs.) Attention that
    materialises scores (masks, unfused kernels) keeps fp32 scores and probabilities in every
    layer, 8 * heads * layers * T^2; fused causal SDPA keeps none. fixed: three fp32 copies of
    one logits chunk.
    Conservative by design: every activation counted as saved, no reuse between them.
    """

    per_token: int
    scores_per_token_sq: int
    fixed: int
    batch_tokens: int

    @classmethod
    def from_config(
        cls,
        config: dict[str, Any],
        element_bytes: int,
        checkpointing: bool,
        batch_tokens: int,
        chunk_tokens: int,
        materialised_scores: bool,
    ) -> PassCost:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        layers = int(config["num_hidden_layers"])
        width = int(config.get("intermediate_size") or 4 * hidden)
        if config.get("moe_intermediate_size") and config.get("num_experts_per_tok"):
            routed = int(config["moe_intermediate_size"]) * int(config["num_experts_per_tok"])
            shared = int(config.get("shared_expert_intermediate_size") or 0)
            shared += int(config["moe_intermediate_size"]) * int(
                config.get("n_shared_experts") or 0
            )
            width = max(width, routed + shared)
        e = element_bytes
        layer = e * (4 * hidden + 4 * width + head_dim * (7 * heads + 4 * kv_heads))
        if config.get("moe_intermediate_size") and config.get("num_experts_per_tok"):
            # Per (token, expert) pair: its gathered input, base and LoRA outputs and copies.
            pair = 5 * hidden + 9 * int(config["moe_intermediate_size"])
            layer += e * int(config["num_experts_per_tok"]) * pair
        if e < 4:
            layer += 4 * (5 * hidden + heads * head_dim + width)
        if checkpointing:
            per_token = layers * e * hidden + 2 * layer
        else:
            per_token = (layers + 1) * layer + e * hidden
        vocab = int(config["vocab_size"])
        return cls(
            per_token=per_token,
            scores_per_token_sq=8 * heads * layers if materialised_scores else 0,
            fixed=3 * 4 * chunk_tokens * vocab,
            batch_tokens=batch_tokens,
        )

    def pass_bytes(self, longest_row: int) -> int:
        tokens = max(longest_row, self.batch_tokens)
        return self.per_token * tokens + self.scores_per_token_sq * longest_row**2 + self.fixed

    def budget(self, budget_bytes: int, context: int, source: str) -> MemoryBudget:
        """The longest row (<= context) whose pass fits in `budget_bytes`."""
        low, high = 0, context
        while low < high:  # largest T with pass_bytes(T) <= budget: pass_bytes grows with T
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.pass_bytes(mid) <= budget_bytes else (low, mid - 1)
        if low == 0:
            raise ValueError(
                f"a training micro-batch of {self.batch_tokens} tokens needs "
                f"{self.pass_bytes(1) / GIB:.2f} GiB, over the trainer's memory budget of "
                f"{budget_bytes / GIB:.2f} GiB ({source}): lower --micro-batch-tokens or raise "
                "--trainer-memory-budget"
            )
        return MemoryBudget(budget_bytes, low, source)


def cpu_budget(configured: int) -> tuple[int, str]:
    """Host memory a CPU pass may use: `configured` bytes if given, else CPU_SHARE of what this
    process could still take: the available RAM, or less under an address-space limit."""
    if configured > 0:
        return configured, "--trainer-memory-budget"
    room, what = available_ram(), "available RAM"
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit != resource.RLIM_INFINITY:
        left = limit - address_space()
        if left < room:
            room, what = max(left, 0), "the trainer's address-space limit (RLIMIT_AS)"
    return int(room * CPU_SHARE), f"{int(CPU_SHARE * 100)}% of {what}"


def available_ram() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def address_space() -> int:
    """This process's mapped address space (what RLIMIT_AS counts)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cuda_budget(free: int, total: int, configured: int) -> tuple[int, str]:
    """Device memory a CUDA pass may use: `configured` bytes if given, else the free memory after
    the model loaded minus CUDA_MARGIN of the device."""
    if configured > 0:
        return configured, "--trainer-memory-budget"
    margin = int(total * CUDA_MARGIN)
    return max(free - margin, 0), f"free device memory after load - {int(CUDA_MARGIN * 100)}%"


def describe(budget: MemoryBudget) -> str:
    """The budget in words, as messages and logs give it."""
    return f"{budget.budget_bytes / GIB:.2f} GiB ({budget.source})"
