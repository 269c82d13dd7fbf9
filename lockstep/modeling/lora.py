"""Multi-tenant LoRA: many adapters live in one base model; each batch ROW picks its own adapter.

`LoraModel` swaps every targeted `nn.Linear` of a HF model for a `MultiLoRALinear`, which computes
`base(x) + scale_a * (x @ A_a.T) @ B_a.T` with `a` = the adapter of x's row. Rows are grouped by
adapter (sorted segments): each adapter's rows take one GEMM pair with that adapter's own A / B,
so a row's output does not depend on which other rows or adapters share the batch, and K
adapters cost K small GEMM pairs per layer (no per-row copies of adapter weights).

A "row" of the routing is a batch row, or a fixed-size block of one packed sequence (the trainer
concatenates a micro-batch's rows, each padded to whole blocks, so every block has one adapter).

Adapter parameters are NOT registered as submodule parameters: the base model's `state_dict()`
keeps its HF key names, and the engines reach adapters through `adapter_parameters(...)`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from lockstep.engine.types import LoraSpec

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGETS = ("lm_head",)
DEFAULT_TARGETS = ATTN_TARGETS + MLP_TARGETS + UNEMBED_TARGETS
PEFT_PREFIX = "base_model.model."


def spec_targets(spec: LoraSpec) -> tuple[str, ...]:
    """Leaf module names an adapter with this spec trains."""
    return (
        (ATTN_TARGETS if spec.train_attn else ())
        + (MLP_TARGETS if spec.train_mlp else ())
        + (UNEMBED_TARGETS if spec.train_unembed else ())
    )


def validate_spec(spec: LoraSpec) -> None:
    if spec.rank < 1:
        raise ValueError(f"rank must be >= 1, got {spec.rank}")
    if not spec_targets(spec):
        raise ValueError("at least one of train_attn, train_mlp, train_unembed must be true")


def init_adapter_state(
    spec: LoraSpec, shapes: dict[str, tuple[int, int]]
) -> dict[str, torch.Tensor]:
    """A fresh adapter in PEFT keys for layers `path -> (in, out)`: A ~ kaiming-uniform (PEFT's
    init) from a generator seeded by (spec.seed, path), B = 0. Shared by every training engine so
    the same seed gives the same adapter whatever engine or sharding holds it."""
    seed = spec.seed if spec.seed is not None else 0
    state: dict[str, torch.Tensor] = {}
    for path, (fan_in, fan_out) in shapes.items():
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(path.encode())) % 2**63)
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5))
        a = (torch.rand(spec.rank, fan_in, generator=gen) * 2 - 1) * bound
        state[f"{PEFT_PREFIX}{path}.lora_A.weight"] = a
        state[f"{PEFT_PREFIX}{path}.lora_B.weight"] = torch.zeros(fan_out, spec.rank)
    return state


def check_adapter_state(
    state: dict[str, torch.Tensor],
    spec: LoraSpec,
    shapes: dict[str, tuple[int, int]],
    strict: bool = True,
) -> list[str]:
    """Check PEFT-named tensors against the layers `shapes` (path -> (in, out)) that `spec`
    targets on a model; returns the paths present. Every engine loads adapters through this.

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
        fan_in, fan_out = shapes[path]
        a = state[f"{PEFT_PREFIX}{path}.lora_A.weight"]
        b = state[f"{PEFT_PREFIX}{path}.lora_B.weight"]
        if tuple(a.shape) != (spec.rank, fan_in) or tuple(b.shape) != (fan_out, spec.rank):
            raise ValueError(
                f"{path}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit rank "
                f"{spec.rank} and layer {fan_in}->{fan_out}"
            )
    return paths


@dataclass
class _Segment:
    """The batch rows of one adapter: a slice when contiguous, else an index."""

    adapter_id: str
    start: int
    stop: int
    index: torch.Tensor | None  # None: rows start..stop-1, contiguous
    mask: torch.Tensor | None  # [n * per_row] fp32, 0 on padding; None: no padding


class _Routing:
    """Which adapter each batch row uses, grouped into per-adapter segments once per layout.

    Rows of one adapter go through that adapter's matmuls together ([n * tokens, in] @ A.T), so a
    layer costs one small GEMM pair per adapter present, never a per-row copy of the weights.
    Callers that can (the training engine) order rows by adapter, so segments are plain slices.
    """

    def __init__(self, adapter_ids: Sequence[str | None], valid: torch.Tensor | None) -> None:
        self.adapter_ids = list(adapter_ids)
        self.valid = valid
        self._valid_cpu = None if valid is None else valid.detach().to("cpu", torch.bool)
        self._segments: dict[tuple[int, torch.device], list[_Segment]] = {}

    def segments(self, x: torch.Tensor, in_features: int) -> list[_Segment]:
        """Segments for x viewed as [rows, per_row, in], in row order (cached per layout)."""
        rows = len(self.adapter_ids)
        # A batch of `rows` rows, or ONE packed sequence routed in `rows` equal blocks.
        packed = x.shape[0] == 1 and x.numel() % max(1, rows * in_features) == 0
        if x.shape[0] != rows and not packed:
            raise ValueError(f"batch has {x.shape[0]} rows but {rows} adapter ids were routed")
        per_row = x.numel() // (rows * in_features) if rows else 0
        key = (per_row, x.device)
        if key not in self._segments:
            self._segments[key] = self._build(per_row, x.device)
        return self._segments[key]

    def _build(self, per_row: int, device: torch.device) -> list[_Segment]:
        groups: dict[str, list[int]] = {}
        for row, aid in enumerate(self.adapter_ids):
            if aid is not None:
                groups.setdefault(aid, []).append(row)
        masked = self.valid is not None and tuple(self.valid.shape) == (
            len(self.adapter_ids),
            per_row,
        )
        out = []
        for aid, rows in groups.items():
            contiguous = rows == list(range(rows[0], rows[-1] + 1))
            index = None if contiguous else torch.tensor(rows, dtype=torch.long, device=device)
            mask = None
            if masked:
                assert self.valid is not None and self._valid_cpu is not None
                if not bool(self._valid_cpu[rows].all()):
                    sel = self.valid[rows[0] : rows[-1] + 1] if index is None else self.valid[index]
                    mask = sel.to(device, torch.float32).reshape(-1)
            out.append(_Segment(aid, rows[0], rows[-1] + 1, index, mask))
        return sorted(out, key=lambda seg: seg.start)


class _RoutingSlot:
    """Shared by every MultiLoRALinear of a LoraModel: the routing of the current forward."""

    def __init__(self) -> None:
        self.current: _Routing | None = None


class MultiLoRALinear(nn.Module):
    """A frozen linear layer plus any number of LoRA adapters, applied per batch row.

    Keeps the wrapped layer's `weight` / `bias` as its own parameters so base state-dict keys do
    not change. Different adapters may have different ranks; an adapter may skip this layer.
    The base matmul runs in the model's dtype; the adapter path in fp32 (the adapters' dtype).
    """

    def __init__(self, base: nn.Linear, slot: _RoutingSlot) -> None:
        super().__init__()
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self._slot = slot
        self.lora_A: dict[str, nn.Parameter] = {}
        self.lora_B: dict[str, nn.Parameter] = {}
        self.scale: dict[str, float] = {}

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

    def _assemble(
        self, segments: list[_Segment], deltas: list[torch.Tensor], rows: int, per_row: int
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


class LoraModel:
    """A HF causal LM whose targeted linear layers carry many tenants' LoRA adapters."""

    def __init__(self, base: PreTrainedModel) -> None:
        self.base = base
        self._slot = _RoutingSlot()
        self._layers: dict[str, MultiLoRALinear] = {}  # module path -> layer, model order
        self._specs: dict[str, LoraSpec] = {}
        for path, module in list(base.named_modules()):
            leaf = path.rsplit(".", 1)[-1]
            if leaf in DEFAULT_TARGETS and isinstance(module, nn.Linear):
                parent = base.get_submodule(path.rsplit(".", 1)[0]) if "." in path else base
                layer = MultiLoRALinear(module, self._slot)
                setattr(parent, leaf, layer)
                self._layers[path] = layer
        if not self._layers:
            raise ValueError(f"{type(base).__name__} has no LoRA-targetable linear layers")

    # -- adapters -------------------------------------------------------------------------

    def adapter_ids(self) -> list[str]:
        return list(self._specs)

    def has_adapter(self, adapter_id: str) -> bool:
        return adapter_id in self._specs

    def spec(self, adapter_id: str) -> LoraSpec:
        return self._specs[adapter_id]

    def target_paths(self, spec: LoraSpec) -> list[str]:
        targets = spec_targets(spec)
        return [p for p in self._layers if p.rsplit(".", 1)[-1] in targets]

    def add_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        """Create an adapter: A ~ kaiming-uniform (PEFT's init) seeded by spec.seed, B = 0.

        Each layer draws A from its own generator seeded by (seed, layer path), so a layer's init
        does not depend on which other layers the spec targets. `seed=None` means seed 0.
        """
        validate_spec(spec)
        if adapter_id in self._specs:
            raise ValueError(f"adapter {adapter_id!r} already exists")
        shapes = {
            p: (self._layers[p].in_features, self._layers[p].out_features)
            for p in self.target_paths(spec)
        }
        self.load_adapter_state(adapter_id, init_adapter_state(spec, shapes), spec)

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
        """Detached CPU copies under PEFT key names."""
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
        state: dict[str, torch.Tensor],
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
        shapes = {
            p: (self._layers[p].in_features, self._layers[p].out_features)
            for p in self.target_paths(spec)
        }
        paths = check_adapter_state(state, spec, shapes, strict)
        new: dict[str, tuple[nn.Parameter, nn.Parameter]] = {}
        for path in paths:
            layer = self._layers[path]
            a = state[f"{PEFT_PREFIX}{path}.lora_A.weight"]
            b = state[f"{PEFT_PREFIX}{path}.lora_B.weight"]
            dev = layer.weight.device
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
        self._slot.current = _Routing(adapter_ids, valid)
        try:
            yield
        finally:
            self._slot.current = previous
