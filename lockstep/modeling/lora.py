"""Multi-tenant LoRA: many adapters live in one base model; each batch ROW picks its own adapter.

`LoraModel` swaps every LoRA target of a HF model (`lora_targets.py` says which: by role, not by
name) for a multi-adapter layer: an `nn.Linear` becomes a `MultiLoRALinear` (`linear_lora.py`),
which computes `base(x) + scale_a * (x @ A_a.T) @ B_a.T` with `a` = the adapter of x's row; a
fused experts module becomes a `MultiLoRAExperts` (`experts.py`: a LoRA on every expert's w1 /
w3 / w2, held as 3-D tensors). Rows are grouped by adapter (sorted segments): each adapter's
rows go through that adapter's own A / B, so a row's output does not depend on which other rows
or adapters share the batch (beyond float rounding), and no row copies adapter weights. When the
segments lie side by side (the trainer orders rows by adapter) the K adapters of a layer take
ONE grouped GEMM pair over their runs of tokens; otherwise each adapter takes one GEMM pair of
its own.

A "row" of the routing is a batch row, or a fixed-size block of one packed sequence (the trainer
concatenates a micro-batch's rows, each padded to whole blocks, so every block has one adapter).

Adapter parameters are NOT registered as submodule parameters: the base model's `state_dict()`
keeps its HF key names, and the engines reach adapters through `adapter_parameters(...)`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import NamedTuple, Protocol

import torch
from torch import nn
from transformers import PreTrainedModel

from lockstep.engine.types import LoraSpec
from lockstep.modeling import packing
from lockstep.modeling.architecture import Architecture, describe
from lockstep.modeling.experts import MultiLoRAExperts
from lockstep.modeling.linear_lora import MultiLoRALinear
from lockstep.modeling.lora_targets import Role, text_path
from lockstep.modeling.routing import Routing, RoutingSlot

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
        self._layers: dict[str, _Slot] = {}  # adapter path (Tinker's name) -> slot, model order
        self._shapes: dict[str, LoraShape] = {}
        self._roles: dict[str, Role] = {}
        self._specs: dict[str, LoraSpec] = {}
        # Gate-less experts' empty w3 in Tinker's files: placeholder path -> the path it sits by.
        self._placeholders: dict[str, str] = {}
        # A module path whose adapter file name differs (gpt-oss `self_attn`; fused projections
        # trained as parts) -> its names, for adapters written in transformers' names.
        self._aliases: dict[str, tuple[str, ...]] = {}
        for target in self.arch.targets:
            parent_path, _, leaf = target.path.rpartition(".")
            parent = base.get_submodule(parent_path) if parent_path else base
            if isinstance(target.module, nn.Linear):
                ranges = [(p.start, p.stop) for p in target.parts]
                layer = MultiLoRALinear(target.module, self._slot, ranges)
                setattr(parent, leaf, layer)
                names = [p.name for p in target.parts] or [target.name]
                for name, slot in zip(names, layer.slots, strict=True):
                    shape = LoraShape(slot.in_features, slot.out_features)
                    self._add(name, target.role, slot, shape)
                if names != [text_path(target.path)]:
                    self._aliases[text_path(target.path)] = tuple(names)
            else:
                experts = MultiLoRAExperts(target.module, self._slot)
                setattr(parent, leaf, experts)
                for which, expert_slot in experts.slots.items():
                    shape = LoraShape(
                        expert_slot.in_features, expert_slot.out_features, expert_slot.experts
                    )
                    self._add(f"{target.name}.{which}", target.role, expert_slot, shape)
                first = f"{target.name}.{next(iter(experts.slots))}"
                for which in experts.placeholders:
                    self._placeholders[f"{target.name}.{which}"] = first
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
        """Detached CPU copies under PEFT key names (experts: 3-D, Tinker's layout; gate-less
        experts with Tinker's empty w3 placeholder)."""
        if adapter_id not in self._specs:
            raise KeyError(adapter_id)
        state: dict[str, torch.Tensor] = {}
        for path, layer in self._layers.items():
            if adapter_id in layer.lora_A:
                a, b = layer.lora_A[adapter_id], layer.lora_B[adapter_id]
                state[f"{PEFT_PREFIX}{path}.lora_A.weight"] = a.detach().to("cpu", copy=True)
                state[f"{PEFT_PREFIX}{path}.lora_B.weight"] = b.detach().to("cpu", copy=True)
        for placeholder, beside in self._placeholders.items():
            if adapter_id in self._layers[beside].lora_A:
                for ab in ("A", "B"):
                    state[f"{PEFT_PREFIX}{placeholder}.lora_{ab}.weight"] = torch.empty(0)
        return state

    def tinker_names(self, state: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """An adapter written in transformers' module names (a PEFT adapter made by
        tinker-cookbook's `build_lora_adapter`, or a published-layout prefix) in this model's
        adapter names: `model.language_model.` -> `model.`, gpt-oss's `self_attn` -> `attn`, and
        a fused projection's LoRA (rank k*r, block-diagonal) split back into its k parts.

        Raises:
            ValueError: a fused LoRA that is not block-diagonal over the parts (the parts'
                separate LoRA cannot represent it).
        """
        out: dict[str, torch.Tensor] = {}
        for key, tensor in state.items():
            if not key.startswith(PEFT_PREFIX) or tensor.numel() == 0:
                out[key] = tensor
                continue
            path, ab = key[len(PEFT_PREFIX) :].rsplit(".", 2)[0], key.rsplit(".", 2)[-2]
            if path not in self._layers:
                path = text_path(path)
            names = self._aliases.get(path, (path,))
            if len(names) == 1:
                out[f"{PEFT_PREFIX}{names[0]}.{ab}.weight"] = tensor
                continue
            for name, part in zip(names, self._split(path, names, tensor, ab, rank), strict=True):
                out[f"{PEFT_PREFIX}{name}.{ab}.weight"] = part
        return out

    def _split(
        self, path: str, names: tuple[str, ...], tensor: torch.Tensor, ab: str, rank: int
    ) -> list[torch.Tensor]:
        """One fused projection's lora_A [k*r, in] or lora_B [out, k*r] cut into its parts."""
        k = len(names)
        if tensor.shape[0 if ab == "lora_A" else 1] != k * rank:
            raise ValueError(f"{path}: {ab} {tuple(tensor.shape)} is not {k} parts of rank {rank}")
        if ab == "lora_A":
            return [tensor[i * rank : (i + 1) * rank] for i in range(k)]
        parts, covered = [], torch.zeros_like(tensor, dtype=torch.bool)
        start = 0
        for i, name in enumerate(names):
            width = self._shapes[name].fan_out
            cols = slice(i * rank, (i + 1) * rank)
            parts.append(tensor[start : start + width, cols])
            covered[start : start + width, cols] = True
            start += width
        if bool(tensor[~covered].ne(0).any()):
            raise ValueError(
                f"{path}: its LoRA is not block-diagonal over {', '.join(names)} (Tinker trains "
                "those as separate LoRA; this one cannot be split into them)"
            )
        return parts

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
    ) -> Iterator[Routing]:
        """Route batch row i through adapter `adapter_ids[i]` (None = base only) in every forward
        (and its backward) run inside the context; yields the routing (a captured CUDA graph
        keeps it: its kernels read the device tensors the routing built).

        `valid` ([rows, seq] bool, optional): real tokens; padding is then skipped by the LoRA
        path, which keeps each adapter's matmuls identical whatever the batch's padded length.
        It applies only to forwards whose sequence length equals `valid.shape[1]`.
        """
        unknown = sorted({a for a in adapter_ids if a is not None and a not in self._specs})
        if unknown:
            raise KeyError(f"unknown adapter(s): {unknown}")
        previous = self._slot.current
        routing = self._slot.current = Routing(adapter_ids, valid)
        try:
            yield routing
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
