"""What a training pass costs in memory, from the model's shape, and how much memory there is.

Pure Python (no torch): the engines compute their `MemoryBudget` with it at start-up and the
tests check the arithmetic without a model. The scheduler only sees the resulting budget.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

from lockstep.engine.shape import LayerShape, ModelShape
from lockstep.engine.types import MemoryBudget

GIB = 1 << 30
CPU_SHARE = 0.75  # of the memory the trainer could still take: the rest for everything else
CUDA_MARGIN = 0.10  # of the device's total memory, kept free beside a pass (allocator, tenants)


@dataclass(frozen=True)
class PassCost:
    """Bytes one micro-batch of a fused pass holds, for a batch whose longest row has T tokens:

        bytes(T) = per_token * max(T, batch_tokens) + scores_per_token_sq * T^2 + fixed

    per_token sums what each layer keeps per token (`_layer_bytes`: its input and norms, the
    token mixer's projections, the feed-forward part's, each routed (token, expert) pair's,
    and the fp32 copies the adapters take where the base dtype is narrower); without
    checkpointing every layer is kept plus the last one's backward working set, with
    checkpointing only each layer's input plus two recomputed layers. Attention that
    materialises scores (windows, sinks, the model's own masked forward) keeps fp32 scores and
    probabilities in those layers, 8 * heads * T^2 each; fused causal SDPA keeps none. fixed:
    three fp32 copies of one logits chunk. The numbers come from the model's `ModelShape`.
    Conservative by design: every activation counted as saved, no reuse between them.
    """

    per_token: int
    scores_per_token_sq: int
    fixed: int
    batch_tokens: int

    @classmethod
    def from_shape(
        cls,
        shape: ModelShape,
        element_bytes: int,
        checkpointing: bool,
        batch_tokens: int,
        chunk_tokens: int,
        materialised_scores: bool,
    ) -> PassCost:
        e = element_bytes
        layers = [_layer_bytes(shape.hidden, la, e) for la in shape.layers]
        if checkpointing:
            per_token = len(layers) * e * shape.hidden + 2 * max(layers)
        else:
            per_token = sum(layers) + max(layers) + e * shape.hidden
        scored = 0
        for layer in shape.layers:
            att = layer.attention
            if att is not None and (materialised_scores or att.window or att.sinks):
                scored += 8 * att.heads
        return cls(
            per_token=per_token,
            scores_per_token_sq=scored,
            fixed=3 * 4 * chunk_tokens * shape.vocab,
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


def _layer_bytes(hidden: int, layer: LayerShape, e: int) -> int:
    """What one layer keeps per token in a pass (see PassCost)."""
    h = hidden
    base = 4 * h  # input, norms, residual sums
    lora = 5 * h  # fp32 copies of LoRA inputs (where e < 4)
    if layer.attention is not None:
        a = layer.attention
        width = a.heads * (5 * a.head_dim + 2 * a.value_head_dim)
        width += a.kv_heads * 2 * (a.head_dim + a.value_head_dim)
        base += width
        lora += a.heads * a.head_dim
    if layer.recurrent is not None:
        r = layer.recurrent
        base += 2 * r.projected + 3 * r.inner
        lora += r.inner
    pairs = 0
    if layer.ffn is not None:
        f = layer.ffn
        dense = f.shared_width if f.routed else f.width
        base += 4 * dense
        lora += dense
        if f.routed:
            # Per (token, expert) pair: its gathered input, base and LoRA outputs and copies.
            pairs = f.top_k * (5 * h + 9 * f.width)
            lora += f.top_k * f.width
    return e * (base + pairs) + (4 * lora if e < 4 else 0)
