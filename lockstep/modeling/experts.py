"""Mixture-of-experts layers with a LoRA on every expert, for many tenants at once.

transformers 5 keeps a MoE layer's experts as fused 3-D parameters in a module whose layout
flags come from `use_experts_implementation` (`is_transposed`, `is_concatenated` gate|up or
interleaved, `has_bias`, `has_gate`). Two layouts are computed:
- gated: `gate_up_proj` + `down_proj`, activation `_apply_gate` (SwiGLU; gpt-oss: clamped,
  `(up + 1)` gated). LoRA on each expert's gate (w1), up (w3) and down (w2) projections, the way
  Tinker trains MoE models (its adapter files keep them as 3-D tensors
  `experts.w1.lora_A.weight` [experts, rank, in] / `lora_B.weight` [experts, out, rank]).
- gate-less: `up_proj` + `down_proj`, activation `act_fn` (Nemotron-H: relu^2). Tinker keeps
  w1 = up, w2 = down and an empty w3 placeholder (`PLACEHOLDERS`).
`MultiLoRAExperts` replaces such a module, keeping its parameters under the same names, and
computes the same function plus each tenant's LoRA on each expert's projections.

Work is grouped, never gathered per token: the (token, expert) pairs of a call are sorted by
expert, and each base projection is ONE grouped GEMM over every expert's run of pairs. For the
LoRA, the pairs whose adapter trains the layer are regrouped once per call, adapter-major with
expert order kept (group g*E + e: adapter g's pairs routed to expert e), gathered once per
projection input (gate and up share it), and each projection's LoRA is ONE grouped GEMM pair over
all K x E (adapter, expert) groups (`torch._grouped_mm`: no per-adapter or per-expert launches on
CUDA), added back with one index_add. Routing stays dropless and every pair's result depends only
on its token, so a tenant alone and packed get the same numbers (to float rounding). The router
stays frozen (it is not an expert).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.modeling.routing import Routing, RoutingSlot

# Tinker's names for the three expert projections.
GATE, UP, DOWN = "w1", "w3", "w2"
# Gate-less experts: Tinker's w1 is the up projection, w2 the down one, w3 an empty placeholder.
PLAIN_UP, PLAIN_DOWN = "w1", "w2"
PLACEHOLDERS = {"gated": (), "plain": ("w3",)}
ExpertsLayout = Literal["gated", "plain"]
# Use torch's grouped GEMM kernel where it takes the operands (False: one matmul per group;
# benchmarks/moe_gpu.py compares the two).
GROUPED_KERNEL = True
# Each projection's LoRA as one grouped GEMM pair over every (adapter, expert) group of a call
# (False: a gather, a grouped GEMM pair and a copy per adapter and projection, the path this
# replaced; benchmarks/gpu_kernels.py compares the two).
GROUPED_ADAPTERS = True


class ExpertSlot:
    """The adapters' LoRA of one projection of every expert: A [E, r, in], B [E, out, r]."""

    def __init__(self, owner: MultiLoRAExperts, experts: int, fan_in: int, fan_out: int) -> None:
        self._owner = owner
        self.experts = experts
        self.in_features = fan_in
        self.out_features = fan_out
        self.lora_A: dict[str, nn.Parameter] = {}
        self.lora_B: dict[str, nn.Parameter] = {}
        self.scale: dict[str, float] = {}

    @property
    def device(self) -> torch.device:
        return self._owner.down_proj.device


def experts_layout(module: nn.Module) -> ExpertsLayout | None:
    """The layout of a transformers 5 experts module `MultiLoRAExperts` computes, or None."""
    down = getattr(module, "down_proj", None)
    known = (
        isinstance(down, nn.Parameter)
        and down.dim() == 3
        and getattr(module, "has_post_expert_norm", True) is False
        and isinstance(getattr(module, "is_transposed", None), bool)
        and isinstance(getattr(module, "is_concatenated", None), bool)
    )
    if not known:
        return None
    gate = getattr(module, "has_gate", None)
    if gate is True and isinstance(getattr(module, "gate_up_proj", None), nn.Parameter):
        return "gated"
    up = getattr(module, "up_proj", None)
    act = getattr(module, "act_fn", None)
    plain = isinstance(up, nn.Parameter) and up.dim() == 3 and callable(act)
    return "plain" if gate is False and plain else None


class MultiLoRAExperts(nn.Module):
    down_proj: nn.Parameter
    down_proj_bias: nn.Parameter | None

    def __init__(self, base: nn.Module, slot: RoutingSlot) -> None:
        super().__init__()
        layout = experts_layout(base)
        assert layout is not None
        self.layout: ExpertsLayout = layout
        # The same Parameter objects under the same names: state-dict keys do not change.
        src: Any = base  # attributes set by transformers' `use_experts_implementation`
        self._first_name = "gate_up_proj" if layout == "gated" else "up_proj"
        self.register_parameter(self._first_name, getattr(src, self._first_name))
        bias = getattr(src, f"{self._first_name}_bias", None) if src.has_bias else None
        self.register_parameter(f"{self._first_name}_bias", bias)
        self.down_proj = src.down_proj
        self.down_proj_bias = src.down_proj_bias if src.has_bias else None
        self.is_transposed = bool(src.is_transposed)
        self.is_concatenated = bool(src.is_concatenated)
        self._activation: Callable[[torch.Tensor], torch.Tensor] = (
            src._apply_gate if layout == "gated" else src.act_fn
        )
        self.num_experts = int(self.down_proj.shape[0])
        hidden, inter = self._dims()
        self._slot = slot
        if layout == "gated":
            self.slots = {
                GATE: ExpertSlot(self, self.num_experts, hidden, inter),
                UP: ExpertSlot(self, self.num_experts, hidden, inter),
                DOWN: ExpertSlot(self, self.num_experts, inter, hidden),
            }
        else:
            self.slots = {
                PLAIN_UP: ExpertSlot(self, self.num_experts, hidden, inter),
                PLAIN_DOWN: ExpertSlot(self, self.num_experts, inter, hidden),
            }
        self.placeholders: tuple[str, ...] = PLACEHOLDERS[layout]

    def _first(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first projection's weight (gate_up_proj or up_proj) and bias."""
        return self._parameters[self._first_name], self._parameters[f"{self._first_name}_bias"]  # type: ignore[return-value]

    def _dims(self) -> tuple[int, int]:
        """(hidden, intermediate) from the down projection's shape."""
        _, a, b = self.down_proj.shape  # [E, H, I], or [E, I, H] transposed
        return (b, a) if self.is_transposed else (a, b)

    def _fuse(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """[m, I] gate and up parts -> [m, 2I] in the layout of gate_up_proj's output."""
        if self.is_concatenated:
            return torch.cat([gate, up], dim=-1)
        return torch.stack([gate, up], dim=-1).flatten(-2)  # [g0, u0, g1, u1, ...]

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, k = top_k_index.shape
        device = hidden_states.device
        # The (token, expert) pairs, expert-major (stable: by token within an expert).
        expert = top_k_index.reshape(-1)
        order = torch.argsort(expert, stable=True)
        expert = expert.index_select(0, order)
        token = torch.arange(tokens, device=device).repeat_interleave(k).index_select(0, order)
        weight = top_k_weights.reshape(-1).index_select(0, order)
        offsets = group_ends(expert, self.num_experts)
        lora = _AdapterGroups(self._slot.current, self.slots, tokens, token, expert)
        x = hidden_states.index_select(0, token).to(self.down_proj.dtype)
        first, first_bias = self._first()
        h = self._base(x, first, first_bias, expert, offsets)
        if lora.active:
            xs = lora.inputs(x)  # one gather for gate and up
            if self.layout == "gated":
                gate, up = lora.delta(GATE, xs), lora.delta(UP, xs)
                if gate is not None or up is not None:
                    zeros = xs.new_zeros(xs.shape[0], self.slots[GATE].out_features)
                    both = self._fuse(zeros if gate is None else gate, zeros if up is None else up)
                    h = lora.add(h, both)
            else:
                up = lora.delta(PLAIN_UP, xs)
                h = h if up is None else lora.add(h, up)
        h = self._activation(h)
        y = self._base(h, self.down_proj, self.down_proj_bias, expert, offsets)
        if lora.active:
            down = lora.delta(DOWN if self.layout == "gated" else PLAIN_DOWN, lora.inputs(h))
            y = y if down is None else lora.add(y, down)
        y = y * weight.unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token, y.to(hidden_states.dtype))

    def _base(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        expert: torch.Tensor,
        offsets: torch.Tensor,
    ) -> torch.Tensor:
        """Every expert's base projection of its own pairs, one grouped GEMM."""
        y = grouped_mm(x, weight if self.is_transposed else weight.mT, offsets)
        return y if bias is None else y + bias.index_select(0, expert)


class _AdapterGroups:
    """The pairs of one call whose adapter trains any projection of the layer (`names`, in
    routing order), regrouped adapter-major with expert order kept: group g*E + e holds adapter
    g's pairs routed to expert e (`index`: their positions among the call's pairs, `ends`: the
    K x E group ends). An adapter that does not train a projection gets zero weights there (its
    groups add exact zeros); pairs without such an adapter are left alone.

    With GROUPED_ADAPTERS off, the path this replaced: per adapter and projection, a gather of
    its pairs, a grouped GEMM pair over the experts, and a copy into a delta for every pair."""

    def __init__(
        self,
        routing: Routing | None,
        slots: dict[str, ExpertSlot],
        tokens: int,
        token: torch.Tensor,
        expert: torch.Tensor,
    ) -> None:
        self.grouped = GROUPED_ADAPTERS
        self.active = False
        self.names: list[str] = []
        self._slots = slots
        self._pairs = token.shape[0]
        if routing is None:
            return
        present, ordinal = routing.token_adapters(tokens, token.device)
        scales = {w: tuple(slot.scale.get(n) for n in present) for w, slot in slots.items()}
        trains = [any(s[i] is not None for s in scales.values()) for i in range(len(present))]
        self.names = [n for n, t in zip(present, trains, strict=True) if t]
        if not self.names or not self._pairs:
            return
        lut, table = _constants(routing, token.device, present, scales, trains)
        adapter = lut.index_select(0, ordinal + 1).index_select(0, token)  # -1: no LoRA here
        perm = torch.argsort(adapter, stable=True)
        counts = torch.bincount(adapter + 1, minlength=len(self.names) + 1).tolist()
        self.active = counts[0] < self._pairs
        self.index = perm[counts[0] :]
        experts = next(iter(slots.values())).experts
        self._per_adapter: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        if not self.grouped:
            at = counts[0]
            for name, count in zip(self.names, counts[1:], strict=True):
                if count:
                    pairs = perm[at : at + count]
                    ends = group_ends(expert.index_select(0, pairs), experts)
                    self._per_adapter.append((name, pairs, ends))
                at += count
            return
        self.group = adapter.index_select(0, self.index)
        key = self.group * experts + expert.index_select(0, self.index)
        self.ends = group_ends(key, len(self.names) * experts)
        self._scale = {w: (s, row) for (w, s), row in zip(scales.items(), table, strict=True)}
        self._row_scale: dict[tuple[float | None, ...], torch.Tensor] = {}

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of x [pairs, in] the LoRA reads: its pairs, grouped (all pairs when not)."""
        return x.index_select(0, self.index) if self.grouped else x

    def add(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """h [pairs, out] plus the `delta` of `delta(...)` on its pairs."""
        return h.index_add(0, self.index, delta) if self.grouped else h + delta

    def delta(self, which: str, xs: torch.Tensor) -> torch.Tensor | None:
        """The LoRA deltas of projection `which` for the rows `inputs` gave; None when no
        adapter here trains it.

        The GEMMs run in xs's dtype, the base weights' (adapters stay fp32; their gradients
        accumulate in fp32): in bf16 that is the grouped kernel's fast path."""
        slot = self._slots[which]
        if not self.grouped:
            return self._per_adapter_delta(slot, xs)
        weights = [
            (slot.lora_A[n], slot.lora_B[n]) if n in slot.lora_A else None for n in self.names
        ]
        if all(w is None for w in weights):
            return None
        a, b = lora_stack(weights, xs.dtype)  # [K*E, r, in], [K*E, out, r]
        h = grouped_mm(xs, a.mT, self.ends)
        h = h * self._scale_of(which, h.dtype)
        return grouped_mm(h, b.mT, self.ends)

    def _scale_of(self, which: str, dtype: torch.dtype) -> torch.Tensor:
        """[pairs, 1]: each grouped pair's adapter's scale for projection `which` (one gather
        per distinct set of scales, usually one per call)."""
        scales, row = self._scale[which]
        if scales not in self._row_scale:
            per_pair = row.index_select(0, self.group).unsqueeze(1).to(dtype)
            self._row_scale[scales] = per_pair
        return self._row_scale[scales]

    def _per_adapter_delta(self, slot: ExpertSlot, x: torch.Tensor) -> torch.Tensor | None:
        where, parts = [], []
        for name, pairs, ends in self._per_adapter:
            if name not in slot.lora_A:
                continue
            a = slot.lora_A[name].to(x.dtype)  # [E, r, in]
            b = slot.lora_B[name].to(x.dtype)  # [E, out, r]
            h = grouped_mm(x.index_select(0, pairs), a.mT, ends)
            parts.append(grouped_mm(h * slot.scale[name], b.mT, ends))
            where.append(pairs)
        if not parts:
            return None
        out = x.new_zeros(self._pairs, slot.out_features)
        return out.index_copy(0, torch.cat(where), torch.cat(parts))


def _constants(
    routing: Routing,
    device: torch.device,
    present: list[str],
    scales: dict[str, tuple[float | None, ...]],
    trains: list[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lut, table) on `device`, built once per routing and kept in it (every expert layer of a
    forward and its backward shares them, so a layer call copies nothing from the host):
    lut [K+1] int64 maps a token's adapter ordinal + 1 to its position among the adapters that
    train the layer (`trains`; -1: none); table [projections, K'] fp32 their scales (0: not
    trained)."""
    key = ("experts", device, tuple(present), *scales.items())
    cached = routing.constants.get(key)
    if cached is not None:
        return cached
    position, lut = 0, [-1]
    for t in trains:
        lut.append(position if t else -1)
        position += t
    table = [[v or 0.0 for v, t in zip(s, trains, strict=True) if t] for s in scales.values()]
    built = (
        torch.tensor(lut, dtype=torch.long).to(device),
        torch.tensor(table, dtype=torch.float32).to(device),
    )
    routing.constants[key] = built
    return built


def lora_stack(
    adapters: Sequence[tuple[torch.Tensor, torch.Tensor] | None], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adapters' A [(E,) r_i, in] and B [(E,) out, r_i] as A [G, r, in] and B [G, out, r] in
    `dtype` for one grouped GEMM pair: one group per expert of each adapter (one per 2-D
    adapter), in order. Ranks are zero-padded to the largest, rounded up to whole 16-byte rows
    (what the grouped kernel needs of every operand); exact: padded rank rows and columns add
    zeros. None: an adapter that does not train it, all zeros (its groups add exact zeros).
    Autograd reaches each adapter's own tensors and nothing else."""
    real = [w for w in adapters if w is not None]
    a0, b0 = real[0]
    align = 16 // dtype.itemsize
    rank = -(-max(a.shape[-2] for a, _ in real) // align) * align
    groups = a0.numel() // (a0.shape[-2] * a0.shape[-1])
    a_parts, b_parts = [], []
    for w in adapters:
        if w is None:
            a_parts.append(a0.new_zeros(groups, rank, a0.shape[-1], dtype=dtype))
            b_parts.append(b0.new_zeros(groups, b0.shape[-2], rank, dtype=dtype))
            continue
        a, b = (t.to(dtype).reshape(-1, *t.shape[-2:]) for t in w)
        missing = rank - a.shape[-2]
        a_parts.append(F.pad(a, (0, 0, 0, missing)) if missing else a)
        b_parts.append(F.pad(b, (0, missing)) if missing else b)
    if len(a_parts) == 1:
        return a_parts[0], b_parts[0]
    return torch.cat(a_parts), torch.cat(b_parts)


def group_ends(sorted_groups: torch.Tensor, groups: int) -> torch.Tensor:
    """int32 end offset of each group's run in a sorted group index (empty groups included)."""
    return torch.bincount(sorted_groups, minlength=groups).cumsum(0).to(torch.int32)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [m, k] in runs of rows (group g: rows ends[g-1]..ends[g]-1) @ w [G, k, n] -> [m, n].

    torch's grouped GEMM kernel where it takes the operands (16-byte aligned strides; CUDA
    needs sm80+), else one matmul per non-empty group."""
    if GROUPED_KERNEL and _kernel_takes(x, w):
        y = torch._grouped_mm(x, w, offs=ends)
        # Its backward needs the same strides of the gradient; a part of a fused gate|up has not.
        if y.requires_grad:
            y.register_hook(torch.Tensor.contiguous)  # type: ignore[no-untyped-call]
        return y
    parts, start = [], 0
    for g, end in enumerate(ends.tolist()):
        if end > start:
            parts.append(x[start:end] @ w[g])
        start = end
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


def _kernel_takes(*operands: torch.Tensor) -> bool:
    if operands[0].is_cuda and torch.cuda.get_device_capability(operands[0].device) < (8, 0):
        return False
    for t in operands:
        if t.data_ptr() % 16 or t.dtype != operands[0].dtype:
            return False
        for size, stride in zip(t.shape, t.stride(), strict=True):
            if size > 1 and stride != 1 and (stride * t.element_size()) % 16:
                return False
    return True
