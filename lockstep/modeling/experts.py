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
LoRA, the pairs are regrouped once per call, adapter-major with expert order kept (group g*E + e:
the g-th adapter's pairs routed to expert e; the pairs without an adapter that trains the layer
ride in the first adapter's groups at a scale of 0), gathered once per projection input (gate and
up share it), and each projection's LoRA is ONE grouped GEMM pair over all K x E groups
(`torch._grouped_mm`: no per-adapter or per-expert launches on CUDA; cut into runs under the
backend's group limit, `grouped_gemm.py`), added back with one index_add. Nothing is read back
to the host, so a decode step can be captured as a CUDA graph. Routing stays dropless and every
pair's result depends only on its token, so a tenant alone and packed get the same numbers (to
float rounding). The router stays frozen (it is not an expert).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from lockstep.modeling.grouped_gemm import (
    Cuts,
    cuts_between,
    group_ends,
    group_limit,
    grouped_mm,
    lora_stack,
)
from lockstep.modeling.routing import Routing, RoutingSlot

# Tinker's names for the three expert projections.
GATE, UP, DOWN = "w1", "w3", "w2"
# Gate-less experts: Tinker's w1 is the up projection, w2 the down one, w3 an empty placeholder.
PLAIN_UP, PLAIN_DOWN = "w1", "w2"
PLACEHOLDERS = {"gated": (), "plain": ("w3",)}
ExpertsLayout = Literal["gated", "plain"]
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


# The layout flags transformers' `use_experts_implementation` sets on an experts module that
# Lockstep computes, each with the value it means where the installed release does not declare
# it (has_post_expert_norm arrived in 5.20; before it no experts module had such a norm).
LAYOUT_FLAGS: dict[str, bool | None] = {
    "is_concatenated": None,
    "is_transposed": None,
    "has_bias": None,
    "has_gate": None,
    "has_post_expert_norm": False,
}
# The decorator's arguments that are not layout flags.
_NOT_FLAGS = frozenset({"experts_class", "experts_interface"})


@functools.cache
def declared_flags() -> frozenset[str]:
    """The layout flags the installed transformers declares (its decorator's keyword arguments)."""
    from transformers.integrations import moe

    names = inspect.signature(moe.use_experts_implementation).parameters
    return frozenset(names) - _NOT_FLAGS


def unreadable_flags() -> list[str]:
    """Layout flags the installed transformers declares that Lockstep does not compute: experts
    modules of such a release are refused (`decoder_layers.refuse_unknown_experts`)."""
    return sorted(declared_flags() - set(LAYOUT_FLAGS))


def _layout_flags(module: nn.Module) -> dict[str, bool] | None:
    """The module's layout flags, read as the installed release declares them; None when one is
    missing or the release declares one Lockstep does not compute."""
    declared = declared_flags()
    if declared - set(LAYOUT_FLAGS):
        return None
    flags = {}
    for name, absent in LAYOUT_FLAGS.items():
        value = getattr(module, name, None) if name in declared else absent
        if not isinstance(value, bool):
            return None
        flags[name] = value
    return flags


def experts_layout(module: nn.Module) -> ExpertsLayout | None:
    """The layout of a transformers 5 experts module `MultiLoRAExperts` computes, or None."""
    down = getattr(module, "down_proj", None)
    if not (isinstance(down, nn.Parameter) and down.dim() == 3):
        return None
    flags = _layout_flags(module)
    if flags is None or flags["has_post_expert_norm"]:
        return None
    if flags["has_gate"] and isinstance(getattr(module, "gate_up_proj", None), nn.Parameter):
        return "gated"
    up = getattr(module, "up_proj", None)
    act = getattr(module, "act_fn", None)
    plain = isinstance(up, nn.Parameter) and up.dim() == 3 and callable(act)
    return "plain" if not flags["has_gate"] and plain else None


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
    """The pairs of one call regrouped adapter-major with expert order kept: group g*E + e holds
    the pairs of the g-th adapter that trains any projection of the layer (`names`, in routing
    order) routed to expert e, the pairs without one in the first adapter's groups with a scale
    of 0 (their deltas and their gradients are exact zeros). `index`: the pairs' positions in
    that order, `ends`: the K x E group ends. An adapter that does not train a projection gets
    zero weights there.

    Every shape is the call's, and nothing is read back to the host (the routing's constants are
    on the device from the first layer on), so a decode step can be captured as a CUDA graph;
    only a call with more groups than the backend takes at once reads its per-adapter counts to
    place the cuts.

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
        self.active = True
        lut, table = _constants(routing, token.device, present, scales, trains)
        # Each pair's adapter, 1-based (0: no LoRA here), which is also its row of the scales.
        slot = lut.index_select(0, ordinal + 1).index_select(0, token)
        experts = next(iter(slots.values())).experts
        if not self.grouped:
            self._per_adapter = _per_adapter_pairs(slot, expert, self.names, experts)
            return
        group = (slot - 1).clamp_min(0)  # pairs without an adapter ride with the first's
        key = group * experts + expert
        self.index = torch.argsort(key, stable=True)
        self.scale_index = slot.index_select(0, self.index)
        parts = len(self.names)
        self.ends = group_ends(key.index_select(0, self.index), parts * experts)
        # Past the backend's group limit: cut at adapter boundaries, their rows counted once.
        limit = group_limit(token.device)
        self.cuts: Cuts | None = None
        if limit is not None and parts * experts > limit:
            counts = torch.bincount(group, minlength=parts).tolist()
            self.cuts = cuts_between(experts, counts, limit)
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
        h = grouped_mm(xs, a.mT, self.ends, self.cuts)
        h = h * self._scale_of(which, h.dtype)
        return grouped_mm(h, b.mT, self.ends, self.cuts)

    def _scale_of(self, which: str, dtype: torch.dtype) -> torch.Tensor:
        """[pairs, 1]: each grouped pair's adapter's scale for projection `which` (one gather
        per distinct set of scales, usually one per call)."""
        scales, row = self._scale[which]
        if scales not in self._row_scale:
            per_pair = row.index_select(0, self.scale_index).unsqueeze(1).to(dtype)
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


def _per_adapter_pairs(
    group: torch.Tensor, expert: torch.Tensor, names: list[str], experts: int
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The replaced path's work list: each adapter's pairs and their expert group ends."""
    perm = torch.argsort(group, stable=True)
    counts = torch.bincount(group, minlength=len(names) + 1).tolist()
    out, at = [], counts[0]
    for name, count in zip(names, counts[1:], strict=True):
        if count:
            pairs = perm[at : at + count]
            out.append((name, pairs, group_ends(expert.index_select(0, pairs), experts)))
        at += count
    return out


def _constants(
    routing: Routing,
    device: torch.device,
    present: list[str],
    scales: dict[str, tuple[float | None, ...]],
    trains: list[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lut, table) on `device`, built once per routing and kept in it (every expert layer of a
    forward and its backward shares them, so a layer call copies nothing from the host):
    lut [K+1] int64 maps a token's adapter ordinal + 1 to its group: 1 + its position among the
    adapters that train the layer (`trains`), 0 for none; table [projections, 1 + K'] fp32 each
    group's scale (0: group 0, or not trained)."""
    key = ("experts", device, tuple(present), *scales.items())
    cached = routing.constants.get(key)
    if cached is not None:
        return cached
    position, lut = 1, [0]
    for t in trains:
        lut.append(position if t else 0)
        position += t
    table = [
        [0.0, *(v or 0.0 for v, t in zip(s, trains, strict=True) if t)] for s in scales.values()
    ]
    built = (
        torch.tensor(lut, dtype=torch.long).to(device),
        torch.tensor(table, dtype=torch.float32).to(device),
    )
    routing.constants[key] = built
    return built
