"""Multi-tenant LoRA: many adapters live in one base model; each batch ROW picks its own adapter.

`LoraModel` swaps every LoRA target of a HF model (`architecture.py` says which: by role, not by
name) for a multi-adapter layer: an `nn.Linear` becomes a `MultiLoRALinear`, which computes
`base(x) + scale_a * (x @ A_a.T) @ B_a.T` with `a` = the adapter of x's row; a fused experts
module becomes a `MultiLoRAExperts` (`experts.py`: a LoRA on every expert's w1 / w3 / w2, held
as 3-D tensors). Rows are grouped by adapter (sorted segments): each adapter's rows go through
that adapter's own A / B, so a row's output does not depend on which other rows or adapters
share the batch (beyond float rounding), and no row copies adapter weights. When the segments
lie side by side (the trainer orders rows by adapter) the K adapters of a layer take ONE grouped
GEMM pair over their runs of tokens; otherwise each adapter takes one GEMM pair of its own.

A "row" of the routing is a batch row, or a fixed-size block of one packed sequence (the trainer
concatenates a micro-batch's rows, each padded to whole blocks, so every block has one adapter).

Adapter parameters are NOT registered as submodule parameters: the base model's `state_dict()`
keeps its HF key names, and the engines reach adapters through `adapter_parameters(...)`.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from lockstep.engine.types import LoraSpec
from lockstep.modeling import packing
from lockstep.modeling.architecture import Architecture, Role, describe
from lockstep.modeling.experts import MultiLoRAExperts, grouped_mm
from lockstep.modeling.routing import Routing, RoutingSlot, Segment

# The dense layout's leaf names (Llama / Qwen3), which the Megatron engine converts.
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
EXPERT_TARGETS = ("w1", "w3", "w2")  # Tinker's names of every expert's gate / up / down
UNEMBED_TARGETS = ("lm_head",)
PEFT_PREFIX = "base_model.model."


def spec_targets(spec: LoraSpec) -> tuple[str, ...]:
    """Leaf module names an adapter with this spec trains in the dense layout (Megatron)."""
    return (
        (ATTN_TARGETS if spec.train_attn else ())
        + (MLP_TARGETS + EXPERT_TARGETS if spec.train_mlp else ())
        + (UNEMBED_TARGETS if spec.train_unembed else ())
    )


def dense_spec_of(state: Mapping[str, torch.Tensor], rank: int, alpha: float) -> LoraSpec:
    """The spec of an adapter file in the dense layout, from its leaf names (Megatron)."""
    leaves = {k.rsplit(".", 3)[-3] for k in state}
    return LoraSpec(
        rank=rank,
        alpha=alpha,
        seed=None,
        train_attn=bool(leaves & set(ATTN_TARGETS)),
        train_mlp=bool(leaves & set(MLP_TARGETS + EXPERT_TARGETS)),
        train_unembed=bool(leaves & set(UNEMBED_TARGETS)),
    )


def spec_roles(spec: LoraSpec) -> dict[Role, str]:
    """Roles an adapter with this spec trains -> the LoraConfig field that asks for each."""
    asked = {
        Role.ATTN: ("train_attn", spec.train_attn),
        Role.MLP: ("train_mlp", spec.train_mlp),
        Role.UNEMBED: ("train_unembed", spec.train_unembed),
    }
    return {role: field for role, (field, on) in asked.items() if on}


class LoraShape(NamedTuple):
    """A LoRA target's shape: A [rank, in] / B [out, rank], or per expert [experts, ...]."""

    fan_in: int
    fan_out: int
    experts: int | None = None

    def a(self, rank: int) -> tuple[int, ...]:
        lead = () if self.experts is None else (self.experts,)
        return (*lead, rank, self.fan_in)

    def b(self, rank: int) -> tuple[int, ...]:
        lead = () if self.experts is None else (self.experts,)
        return (*lead, self.fan_out, rank)


def validate_spec(spec: LoraSpec) -> None:
    if spec.rank < 1:
        raise ValueError(f"rank must be >= 1, got {spec.rank}")
    if not spec_targets(spec):
        raise ValueError("at least one of train_attn, train_mlp, train_unembed must be true")


def init_adapter_state(spec: LoraSpec, shapes: Mapping[str, LoraShape]) -> dict[str, torch.Tensor]:
    """A fresh adapter in PEFT keys for layers `path -> shape`: A ~ kaiming-uniform (PEFT's init,
    every expert alike) from a generator seeded by (spec.seed, path), B = 0. Shared by every
    training engine so the same seed gives the same adapter whatever engine or sharding holds it."""
    seed = spec.seed if spec.seed is not None else 0
    state: dict[str, torch.Tensor] = {}
    for path, shape in shapes.items():
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(path.encode())) % 2**63)
        bound = 1.0 / math.sqrt(shape.fan_in)  # kaiming_uniform_(a=sqrt(5))
        a = (torch.rand(shape.a(spec.rank), generator=gen) * 2 - 1) * bound
        state[f"{PEFT_PREFIX}{path}.lora_A.weight"] = a
        state[f"{PEFT_PREFIX}{path}.lora_B.weight"] = torch.zeros(shape.b(spec.rank))
    return state


def check_adapter_state(
    state: Mapping[str, torch.Tensor],
    spec: LoraSpec,
    shapes: Mapping[str, LoraShape],
    strict: bool = True,
) -> list[str]:
    """Check PEFT-named tensors against the layers `shapes` (path -> shape) that `spec` targets
    on a model; returns the paths present. Every engine loads adapters through this.

    strict: the keys must be exactly those layers (our own checkpoints). With strict=False a
    subset is accepted (external PEFT adapters that skip some layers), but every layer present
    still needs both A and B.
    Raises:
        ValueError: invalid spec, a key missing or unexpected, or a tensor of the wrong shape.
    """
    validate_spec(spec)
    expected = {f"{PEFT_PREFIX}{p}.lora_{ab}.weight": p for p in shapes for ab in ("A", "B")}
    unexpected = sorted(set(state) - set(expected))
    if not strict:
        expected = {k: p for k, p in expected.items() if p in {expected.get(s) for s in state}}
    missing = sorted(set(expected) - set(state))
    if missing or unexpected:
        raise ValueError(
            f"adapter keys do not match the spec: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    paths = list(dict.fromkeys(expected.values()))
    for path in paths:
        shape = shapes[path]
        a = state[f"{PEFT_PREFIX}{path}.lora_A.weight"]
        b = state[f"{PEFT_PREFIX}{path}.lora_B.weight"]
        if tuple(a.shape) != shape.a(spec.rank) or tuple(b.shape) != shape.b(spec.rank):
            experts = "" if shape.experts is None else f" x {shape.experts} experts"
            raise ValueError(
                f"{path}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit rank "
                f"{spec.rank} and layer {shape.fan_in}->{shape.fan_out}{experts}"
            )
    return paths


class MultiLoRALinear(nn.Module):
    """A frozen linear layer plus any number of LoRA adapters, applied per batch row.

    Keeps the wrapped layer's `weight` / `bias` as its own parameters so base state-dict keys do
    not change. Different adapters may have different ranks; an adapter may skip this layer.
    The base matmul runs in the model's dtype; the adapter path in fp32 (the adapters' dtype).
    """

    def __init__(self, base: nn.Linear, slot: RoutingSlot) -> None:
        super().__init__()
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self._slot = slot
        self.lora_A: dict[str, nn.Parameter] = {}
        self.lora_B: dict[str, nn.Parameter] = {}
        self.scale: dict[str, float] = {}

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def adapter(self, adapter_id: str) -> tuple[nn.Parameter, nn.Parameter, float] | None:
        """(A, B, scale) of `adapter_id` on this layer; None when it does not train it."""
        if adapter_id not in self.lora_A:
            return None
        return self.lora_A[adapter_id], self.lora_B[adapter_id], self.scale[adapter_id]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        routing = self._slot.current
        if routing is None or not self.lora_A:
            return y
        segments = [s for s in routing.segments(x, self.in_features) if s.adapter_id in self.lora_A]
        if not segments:
            return y
        rows = len(routing.adapter_ids)  # batch rows, or blocks of one packed sequence
        x3 = x.reshape(rows, -1, self.in_features)
        per_row = x3.shape[1]
        run = contiguous_run(segments)
        if run is not None and len(segments) > 1 and self._groupable(x.dtype):
            delta = self._grouped(x3[run], segments, per_row, routing)
            return y + self._assemble_run(delta, run, rows, per_row).to(y.dtype).view(y.shape)
        deltas = []
        for seg in segments:
            a, b = self.lora_A[seg.adapter_id], self.lora_B[seg.adapter_id]
            xs = x3[seg.start : seg.stop] if seg.index is None else x3.index_select(0, seg.index)
            n = xs.shape[0]
            # One GEMM pair over the segment's tokens with the adapter's own weights (no copies).
            # M = its tokens, a multiple of 8 in the trainer: the kernel class a tenant's tokens
            # take does not depend on what they are packed with, as for the base matmul.
            h = xs.reshape(n * per_row, -1).to(a.dtype) @ a.t()
            scale = self.scale[seg.adapter_id]
            h = h * scale if seg.mask is None else h * (seg.mask.view(n * per_row, 1) * scale)
            deltas.append((h @ b.t()).view(n, per_row, -1))
        return y + self._assemble(segments, deltas, rows, per_row).to(y.dtype).view(y.shape)

    def _grouped(
        self, xs: torch.Tensor, segments: list[Segment], per_row: int, routing: Routing
    ) -> torch.Tensor:
        """Every segment's LoRA in ONE grouped GEMM pair: xs [n, per_row, in] holds the
        segments' rows back to back, adapter after adapter. Ranks differ between adapters, so A
        and B are zero-padded to the largest (exact: the padded rank columns add zeros); each
        group's product is its adapter's own, so a tenant's numbers do not depend on who else
        is in the batch beyond float rounding. [n, per_row, out]."""
        ids = [s.adapter_id for s in segments]
        # The GEMMs' dtype: the adapters' (fp32), or the base weights' where GROUPED_IN_BASE_DTYPE
        # says so (bf16 is the CUDA grouped kernel's fast path; A and B stay fp32 parameters).
        dtype = xs.dtype if GROUPED_IN_BASE_DTYPE else self.lora_A[ids[0]].dtype
        # Rows of 16 bytes: what the grouped kernel (and its backward) needs of every operand.
        align = 16 // dtype.itemsize
        rank = -(-max(self.lora_A[i].shape[0] for i in ids) // align) * align
        a = torch.stack([_pad(self.lora_A[i], 0, rank) for i in ids]).to(dtype)  # [G, r, in]
        b = torch.stack([_pad(self.lora_B[i], 1, rank) for i in ids]).to(dtype)  # [G, out, r]
        ends, token_scale = self._group_layout(segments, per_row, routing, xs.device)
        flat = xs.reshape(-1, self.in_features).to(dtype)
        h = grouped_mm(flat, a.mT, ends) * token_scale.unsqueeze(1).to(dtype)
        return grouped_mm(h, b.mT, ends).view(xs.shape[0], per_row, self.out_features)

    def _group_layout(
        self, segments: list[Segment], per_row: int, routing: Routing, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 group ends, fp32 per-token scale) of the segments on `device`. Built once per
        routing and kept in it: every layer of a forward (and its backward) with the same
        adapters shares them, so a layer call copies nothing from the host."""
        scales = tuple(self.scale[s.adapter_id] for s in segments)
        key = ("grouped", per_row, device, scales, *((s.start, s.stop) for s in segments))
        cached = routing.constants.get(key)
        if cached is not None:
            return cached
        counts = torch.tensor([(s.stop - s.start) * per_row for s in segments])
        ends = counts.cumsum(0).to(device, torch.int32)
        token_scale = torch.tensor(scales, dtype=torch.float32).repeat_interleave(counts)
        token_scale = token_scale.to(device)
        masks = [s.mask for s in segments]
        if any(m is not None for m in masks):
            token_scale = token_scale * torch.cat(
                [
                    m if m is not None else token_scale.new_ones(int(c))
                    for m, c in zip(masks, counts.tolist(), strict=True)
                ]
            )
        routing.constants[key] = (ends, token_scale)
        return ends, token_scale

    def _groupable(self, base: torch.dtype) -> bool:
        """Whether the grouped kernel takes this layer's sizes in the GEMMs' dtype (fp32, or
        `base` under GROUPED_IN_BASE_DTYPE): both feature dims whole 16-byte rows (real
        models' are; else one GEMM pair each)."""
        align = 16 // (base.itemsize if GROUPED_IN_BASE_DTYPE else 4)
        return self.in_features % align == 0 and self.out_features % align == 0

    def _assemble_run(
        self, delta: torch.Tensor, run: slice, rows: int, per_row: int
    ) -> torch.Tensor:
        """[rows, per_row, out] from the deltas of rows `run`; the rows outside get zeros."""
        if run.start == 0 and run.stop == rows:
            return delta
        before = delta.new_zeros(run.start, per_row, self.out_features)
        after = delta.new_zeros(rows - run.stop, per_row, self.out_features)
        return torch.cat([before, delta, after])

    def _assemble(
        self, segments: list[Segment], deltas: list[torch.Tensor], rows: int, per_row: int
    ) -> torch.Tensor:
        """[rows, per_row, out] from per-segment deltas; rows without an adapter get zeros."""
        first = deltas[0]
        if len(segments) == 1 and segments[0].index is None and first.shape[0] == rows:
            return first
        if all(s.index is None for s in segments):
            parts, at = [], 0
            for seg, d in zip(segments, deltas, strict=True):
                if seg.start > at:
                    parts.append(first.new_zeros(seg.start - at, per_row, self.out_features))
                parts.append(d)
                at = seg.stop
            if at < rows:
                parts.append(first.new_zeros(rows - at, per_row, self.out_features))
            return torch.cat(parts)
        out = first.new_zeros(rows, per_row, self.out_features)
        for seg, d in zip(segments, deltas, strict=True):
            index = seg.index
            if index is None:
                index = torch.arange(seg.start, seg.stop, device=d.device)
            out = out.index_add(0, index, d)
        return out

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, adapters={len(self.lora_A)}"


# Run the grouped LoRA GEMMs in the base weights' dtype (bf16 on CUDA) instead of the adapters'
# fp32, as the experts do; off until benchmarks/gpu_suite.py shows what it buys on a GPU.
GROUPED_IN_BASE_DTYPE = False


def contiguous_run(segments: list[Segment]) -> slice | None:
    """The rows the segments cover when they are plain slices back to back (the trainer orders
    rows by adapter), else None."""
    if any(s.index is not None for s in segments):
        return None
    for before, after in itertools.pairwise(segments):
        if before.stop != after.start:
            return None
    return slice(segments[0].start, segments[-1].stop)


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`t` zero-padded along `dim` (A: rank rows; B: rank columns) to `size`."""
    missing = size - t.shape[dim]
    return t if missing == 0 else torch.cat([t, t.new_zeros(*_with(t.shape, dim, missing))], dim)


def _with(shape: torch.Size, dim: int, size: int) -> tuple[int, ...]:
    return tuple(size if d == dim else n for d, n in enumerate(shape))


class _Slot(Protocol):
    """One LoRA target's adapters: a MultiLoRALinear, or one projection of fused experts."""

    in_features: int
    out_features: int
    lora_A: dict[str, nn.Parameter]
    lora_B: dict[str, nn.Parameter]
    scale: dict[str, float]

    @property
    def device(self) -> torch.device: ...


class LoraModel:
    """A HF causal LM whose LoRA targets carry many tenants' adapters."""

    def __init__(self, base: PreTrainedModel, arch: Architecture | None = None) -> None:
        self.base = base
        self.arch = describe(base) if arch is None else arch
        self._slot = RoutingSlot()
        self._layers: dict[str, _Slot] = {}  # LoRA path -> slot, model order
        self._shapes: dict[str, LoraShape] = {}
        self._roles: dict[str, Role] = {}
        self._specs: dict[str, LoraSpec] = {}
        for target in self.arch.targets:
            parent_path, _, leaf = target.path.rpartition(".")
            parent = base.get_submodule(parent_path) if parent_path else base
            if isinstance(target.module, nn.Linear):
                layer = MultiLoRALinear(target.module, self._slot)
                setattr(parent, leaf, layer)
                shape = LoraShape(layer.in_features, layer.out_features)
                self._add(target.path, target.role, layer, shape)
            else:
                experts = MultiLoRAExperts(target.module, self._slot)
                setattr(parent, leaf, experts)
                for which, slot in experts.slots.items():
                    shape = LoraShape(slot.in_features, slot.out_features, slot.experts)
                    self._add(f"{target.path}.{which}", target.role, slot, shape)
        if not self._layers:
            raise ValueError(f"{type(base).__name__} has no LoRA-targetable layers")

    def _add(self, path: str, role: Role, slot: _Slot, shape: LoraShape) -> None:
        self._layers[path] = slot
        self._shapes[path] = shape
        self._roles[path] = role

    # -- adapters -------------------------------------------------------------------------

    def adapter_ids(self) -> list[str]:
        return list(self._specs)

    def has_adapter(self, adapter_id: str) -> bool:
        return adapter_id in self._specs

    def spec(self, adapter_id: str) -> LoraSpec:
        return self._specs[adapter_id]

    def target_paths(self, spec: LoraSpec) -> list[str]:
        roles = spec_roles(spec)
        return [p for p in self._layers if self._roles[p] in roles]

    def shapes(self, spec: LoraSpec) -> dict[str, LoraShape]:
        """LoRA path -> shape of every layer an adapter with `spec` trains."""
        return {p: self._shapes[p] for p in self.target_paths(spec)}

    def check_spec(self, spec: LoraSpec) -> None:
        """Refuse a spec that asks for a kind of layer this model does not have (it would train
        nothing there, silently).

        Raises:
            ValueError: naming the LoraConfig field that matches no layer.
        """
        validate_spec(spec)
        present = set(self._roles.values())
        for role, field in spec_roles(spec).items():
            if role not in present:
                raise ValueError(
                    f"{field}: {type(self.base).__name__} has no {role.value} layers LoRA can "
                    "train; set it to false"
                )

    def spec_of(self, state: Mapping[str, torch.Tensor], rank: int, alpha: float) -> LoraSpec:
        """The spec of an adapter file: which roles its tensors train on this model."""
        keys = [k[len(PEFT_PREFIX) :] for k in state if k.startswith(PEFT_PREFIX)]
        paths = {k.rsplit(".", 2)[0] for k in keys}
        roles = {self._roles[p] for p in paths if p in self._roles}
        return LoraSpec(
            rank=rank,
            alpha=alpha,
            seed=None,
            train_attn=Role.ATTN in roles,
            train_mlp=Role.MLP in roles,
            train_unembed=Role.UNEMBED in roles,
        )

    def add_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        """Create an adapter: A ~ kaiming-uniform (PEFT's init) seeded by spec.seed, B = 0.

        Each layer draws A from its own generator seeded by (seed, layer path), so a layer's init
        does not depend on which other layers the spec targets. `seed=None` means seed 0.
        """
        self.check_spec(spec)
        if adapter_id in self._specs:
            raise ValueError(f"adapter {adapter_id!r} already exists")
        self.load_adapter_state(adapter_id, init_adapter_state(spec, self.shapes(spec)), spec)

    def remove_adapter(self, adapter_id: str) -> None:
        self._specs.pop(adapter_id, None)
        for layer in self._layers.values():
            layer.lora_A.pop(adapter_id, None)
            layer.lora_B.pop(adapter_id, None)
            layer.scale.pop(adapter_id, None)

    def adapter_parameters(self, adapter_id: str) -> list[nn.Parameter]:
        """[A, B] of every layer the adapter targets, in model order (stable across calls)."""
        if adapter_id not in self._specs:
            raise KeyError(adapter_id)
        out: list[nn.Parameter] = []
        for layer in self._layers.values():
            if adapter_id in layer.lora_A:
                out += [layer.lora_A[adapter_id], layer.lora_B[adapter_id]]
        return out

    def adapter_param_names(self, adapter_id: str) -> list[str]:
        """PEFT key of each tensor of `adapter_parameters(adapter_id)`, in the same order."""
        if adapter_id not in self._specs:
            raise KeyError(adapter_id)
        return [
            f"{PEFT_PREFIX}{path}.lora_{ab}.weight"
            for path, layer in self._layers.items()
            if adapter_id in layer.lora_A
            for ab in ("A", "B")
        ]

    def adapter_state(self, adapter_id: str) -> dict[str, torch.Tensor]:
        """Detached CPU copies under PEFT key names (experts: 3-D, Tinker's layout)."""
        if adapter_id not in self._specs:
            raise KeyError(adapter_id)
        state: dict[str, torch.Tensor] = {}
        for path, layer in self._layers.items():
            if adapter_id in layer.lora_A:
                a, b = layer.lora_A[adapter_id], layer.lora_B[adapter_id]
                state[f"{PEFT_PREFIX}{path}.lora_A.weight"] = a.detach().to("cpu", copy=True)
                state[f"{PEFT_PREFIX}{path}.lora_B.weight"] = b.detach().to("cpu", copy=True)
        return state

    def load_adapter_state(
        self,
        adapter_id: str,
        state: Mapping[str, torch.Tensor],
        spec: LoraSpec,
        strict: bool = True,
    ) -> None:
        """Create or replace `adapter_id` from PEFT-named tensors.

        strict: the keys must be exactly the layers `spec` targets (our own checkpoints). With
        strict=False a subset is accepted (external PEFT adapters that skip some layers), but
        every layer still needs both A and B.
        Raises:
            ValueError: a key is missing or unexpected, or a tensor has the wrong shape.
        """
        paths = check_adapter_state(state, spec, self.shapes(spec), strict)
        new: dict[str, tuple[nn.Parameter, nn.Parameter]] = {}
        for path in paths:
            dev = self._layers[path].device
            a = state[f"{PEFT_PREFIX}{path}.lora_A.weight"]
            b = state[f"{PEFT_PREFIX}{path}.lora_B.weight"]
            new[path] = (
                nn.Parameter(a.detach().to(dev, torch.float32, copy=True)),
                nn.Parameter(b.detach().to(dev, torch.float32, copy=True)),
            )
        self.remove_adapter(adapter_id)  # replace: also clears layers the old spec targeted
        for path, (a_param, b_param) in new.items():
            layer = self._layers[path]
            layer.lora_A[adapter_id] = a_param
            layer.lora_B[adapter_id] = b_param
            layer.scale[adapter_id] = spec.alpha / spec.rank
        self._specs[adapter_id] = spec

    # -- routing --------------------------------------------------------------------------

    @contextmanager
    def row_adapters(
        self, adapter_ids: Sequence[str | None], valid: torch.Tensor | None = None
    ) -> Iterator[None]:
        """Route batch row i through adapter `adapter_ids[i]` (None = base only) in every forward
        (and its backward) run inside the context.

        `valid` ([rows, seq] bool, optional): real tokens; padding is then skipped by the LoRA
        path, which keeps each adapter's matmuls identical whatever the batch's padded length.
        It applies only to forwards whose sequence length equals `valid.shape[1]`.
        """
        unknown = sorted({a for a in adapter_ids if a is not None and a not in self._specs})
        if unknown:
            raise KeyError(f"unknown adapter(s): {unknown}")
        previous = self._slot.current
        self._slot.current = Routing(adapter_ids, valid)
        try:
            yield
        finally:
            self._slot.current = previous

    @contextmanager
    def narrowed(self, start: int, stop: int) -> Iterator[None]:
        """Inside a packed forward: route positions start..stop-1 (whole routing blocks) as the
        entire input, for a layer that runs one packed row at a time (`mixers.py`)."""
        routing, layout = self._slot.current, packing.current()
        if routing is None or layout is None:
            yield
            return
        total = sum(layout.widths)
        block = total // len(routing.adapter_ids)
        self._slot.current = routing.narrow(start // block, stop // block)
        try:
            yield
        finally:
            self._slot.current = routing
