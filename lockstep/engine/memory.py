"""What a training pass costs in memory, from the model's shape, and how much memory there is.

Pure Python (no torch): the engines compute their `MemoryBudget` with it at start-up and the
tests check the arithmetic without a model. The scheduler only sees the resulting budget.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from lockstep.engine.shape import LayerShape, Mixer, ModelShape
from lockstep.engine.types import MemoryBudget

GIB = 1 << 30
CPU_SHARE = 0.75  # of the memory the trainer could still take: the rest for everything else
CUDA_MARGIN = 0.10  # of the device's total memory, kept free beside a pass (allocator, tenants)


# The LoRA rank the pass cost assumes (Tinker's default): each LoRA slot a token passes keeps
# two fp32 rank-wide vectors, 8 * rank bytes.
LORA_RANK = 32


@dataclass(frozen=True)
class PassCost:
    """Bytes one micro-batch of a fused pass holds, for a batch whose longest row has T tokens
    and N = max(T, batch_tokens) tokens in all:

        bytes(T) = per_token * N + scores_per_token_sq * T^2 + logits_per_token * min(N, chunk)

    per_token sums what each layer keeps per token (`_layer_bytes`), in the base dtype's e bytes
    per value: its input (H), 3x its attention projections' widths, 12x a Gated DeltaNet's and
    2x a Mamba-2 mixer's projections (their chunked scans keep more or less per token), 2x the
    dense (or shared-expert) width, 5x each routed (token, expert) pair's input and width; plus
    8 * rank bytes per LoRA slot the token passes (adapters are fp32), plus fp32 copies of the
    LoRA inputs where e < 4. A checkpointed layer keeps only its input (e * H), and the
    backward holds one checkpointed layer's recomputed activations at a time (the largest
    checkpointed layer's bytes, once). Attention that materialises scores keeps them in those
    layers: on the packed path (windows, sinks, a value head narrower than q/k) 6 * heads * T^2
    bytes each, on the generic path (the model's own masked attention) 3 * heads * T^2 in every
    attention layer; fused causal SDPA keeps none. The logits: 2 fp32 copies of one chunk of at most
    `chunk` positions (the fused head's logits and its logsumexp's exponentials,
    `training/logprobs.py`). The numbers come from the model's `ModelShape`; the coefficients are
    measured (tests/unit/test_pass_cost.py checks the formula against the peak a pass really
    takes on the CPU, for every family of the zoo: never under, at most 25 % over; and never
    under with layers checkpointed).
    """

    per_token: int  # with the checkpointing admission counts on (every layer, where allowed)
    scores_per_token_sq: int
    logits_per_token: int
    chunk: int
    batch_tokens: int
    # Per token: each layer's bytes uncheckpointed, a checkpointed layer's input, the head's.
    layers: tuple[int, ...] = ()
    layer_input: int = 0
    head: int = 0

    @classmethod
    def from_shape(
        cls,
        shape: ModelShape,
        element_bytes: int,
        checkpointing: bool,
        batch_tokens: int,
        chunk_tokens: int,
        generic: bool,
    ) -> PassCost:
        """`checkpointing`: whether a pass may checkpoint layers (admission then counts the
        pass with every layer checkpointed; each micro-batch checkpoints only what it must,
        `checkpoint_plan`)."""
        e = element_bytes
        layers = tuple(_layer_bytes(shape.hidden, la, e) for la in shape.layers)
        head = 8 * LORA_RANK * shape.head_slots
        every = range(len(layers)) if checkpointing else ()
        per_token = _per_token(layers, e * shape.hidden, head, every)
        scored = 0
        for layer in shape.layers:
            att = layer.attention
            if att is None:
                continue
            if generic:
                scored += 3 * att.heads
            elif att.window or att.sinks or att.head_dim != att.value_head_dim:
                scored += 6 * att.heads
        return cls(
            per_token=per_token,
            scores_per_token_sq=scored,
            logits_per_token=8 * shape.vocab,
            chunk=chunk_tokens,
            batch_tokens=batch_tokens,
            layers=layers,
            layer_input=e * shape.hidden,
            head=head,
        )

    def pass_bytes(self, longest_row: int) -> int:
        """What admission counts: a micro-batch of up to `batch_tokens` (or one longer row)."""
        tokens = max(longest_row, self.batch_tokens)
        return self._bytes(self.per_token, tokens, longest_row)

    def micro_batch_bytes(
        self, tokens: int, longest_row: int, checkpointed: Collection[int] = ()
    ) -> int:
        """One micro-batch of `tokens` packed tokens whose longest row has `longest_row`, with
        the layers `checkpointed` (indices)."""
        per_token = _per_token(self.layers, self.layer_input, self.head, checkpointed)
        return self._bytes(per_token, tokens, longest_row)

    def checkpoint_plan(self, tokens: int, longest_row: int, budget_bytes: int) -> tuple[int, ...]:
        """The fewest layers to checkpoint for the micro-batch to fit `budget_bytes`, the
        biggest first (every layer when even that does not fit: admission counted that case)."""
        if self.micro_batch_bytes(tokens, longest_row) <= budget_bytes:
            return ()
        chosen: list[int] = []
        for index in sorted(range(len(self.layers)), key=lambda i: (-self.layers[i], i)):
            chosen.append(index)
            if self.micro_batch_bytes(tokens, longest_row, chosen) <= budget_bytes:
                break
        return tuple(sorted(chosen))

    def _bytes(self, per_token: int, tokens: int, longest_row: int) -> int:
        logits = self.logits_per_token * min(tokens, self.chunk)
        return per_token * tokens + self.scores_per_token_sq * longest_row**2 + logits

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


def _per_token(
    layers: tuple[int, ...], layer_input: int, head: int, checkpointed: Collection[int]
) -> int:
    """Bytes per token of a pass with the layers `checkpointed`: the others' activations, the
    checkpointed ones' inputs, and the largest checkpointed layer's while it is recomputed."""
    if not checkpointed:
        return sum(layers) + head
    kept = sum(b for i, b in enumerate(layers) if i not in checkpointed)
    recomputed = max(layers[i] for i in checkpointed)
    return kept + len(checkpointed) * layer_input + recomputed + head


def _layer_bytes(hidden: int, layer: LayerShape, e: int) -> int:
    """What one layer keeps per token in a pass (see PassCost)."""
    values = hidden
    narrow = 2 * hidden  # LoRA inputs cast to fp32 (where e < 4): once per mixer and feed-forward
    if layer.attention is not None:
        a = layer.attention
        values += 3 * (a.heads + a.kv_heads) * (a.head_dim + a.value_head_dim)
        narrow += a.heads * a.head_dim
    if layer.recurrent is not None:
        r = layer.recurrent
        values += (2 if layer.mixer is Mixer.MAMBA else 12) * (r.projected + r.inner)
        narrow += r.inner
    if layer.ffn is not None:
        f = layer.ffn
        dense = f.shared_width if f.routed else f.width
        values += 2 * dense
        narrow += dense
        if f.routed:
            values += 5 * f.top_k * (hidden + f.width)
            narrow += f.top_k * f.width
    lora = 8 * LORA_RANK * layer.lora_slots
    return e * values + lora + (4 * narrow if e < 4 else 0)
