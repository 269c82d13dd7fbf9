"""Multi-tenant LoRA: many adapters live in one base model; each batch ROW picks its own adapter.

`LoraModel` swaps every targeted `nn.Linear` of a HF model for a `MultiLoRALinear`, which computes
`base(x) + scale_a * (x @ A_a.T) @ B_a.T` with `a` = the adapter of x's row. Each row gathers its
own adapter's A / B, zero-padded to the layer's largest rank, and two batched matmuls (one matrix
per row) apply every adapter at once, so a row's output is the same whichever other rows or
adapters share the batch, and the op count does not grow with the number of adapters.

Adapter parameters are NOT registered as submodule parameters: the base model's `state_dict()`
keeps its HF key names, and the engines reach adapters through `adapter_parameters(...)`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

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


class _Routing:
    """Which adapter each batch row uses; per-layout gather plans are cached for the forward."""

    def __init__(self, adapter_ids: Sequence[str | None], valid: torch.Tensor | None) -> None:
        self.adapter_ids = list(adapter_ids)
        self.valid = None if valid is None else valid.detach().to("cpu", torch.bool)  # one sync
        self._plans: dict[tuple[object, ...], _Plan | None] = {}

    def plan(
        self, x: torch.Tensor, in_features: int, ranks: dict[str, int], scales: dict[str, float],
        r_max: int,
    ) -> _Plan | None:
        """Gather plan for x viewed as [rows, n, in] over the adapters in `ranks` (this layer's).

        Layers with the same adapter set, rank padding and token layout share one plan, so it is
        built once per forward, not once per layer. None when no row uses any of these adapters.
        """
        rows = len(self.adapter_ids)
        if x.shape[0] != rows:
            raise ValueError(f"batch has {x.shape[0]} rows but {rows} adapter ids were routed")
        per_row = x.numel() // (rows * in_features) if rows else 0
        active = list(dict.fromkeys(a for a in self.adapter_ids if a is not None and a in ranks))
        key = (per_row, x.device, r_max, tuple((a, ranks[a], scales[a]) for a in active))
        if key in self._plans:
            return self._plans[key]
        plan = _Plan.build(self.adapter_ids, active, ranks, scales, r_max, per_row, self.valid)
        if plan is not None:
            plan = plan.to(x.device)
        self._plans[key] = plan
        return plan


class _Plan:
    """Per-row gather of zero-padded adapter weights for one layer layout.

    The active adapters' A (and B) are concatenated along the rank axis, with one zero slice
    appended; `index` [rows * r_max] picks, for each row, its adapter's rank slices followed by
    zero slices up to r_max (rows without an adapter here get only zero slices). `coef`
    [rows, n, r_max] is the adapter's scale on real tokens and 0 on padding tokens, so padding and
    unrouted tokens get an exact-zero delta, and each row's matmuls only see its own adapter.
    """

    def __init__(self, active: list[str], index: torch.Tensor, coef: torch.Tensor) -> None:
        self.active = active
        self.index = index
        self.coef = coef

    @staticmethod
    def build(
        adapter_ids: list[str | None],
        active: list[str],
        ranks: dict[str, int],
        scales: dict[str, float],
        r_max: int,
        per_row: int,
        valid: torch.Tensor | None,
    ) -> _Plan | None:
        if not active:
            return None
        offsets: dict[str, int] = {}
        total = 0
        for aid in active:
            offsets[aid] = total
            total += ranks[aid]
        zero = total  # the appended zero slice
        rows = len(adapter_ids)
        index = torch.full((rows, r_max), zero, dtype=torch.long)
        scale = torch.zeros(rows, 1, r_max)
        for row, routed in enumerate(adapter_ids):
            if routed is None or routed not in offsets:
                continue
            r = ranks[routed]
            index[row, :r] = torch.arange(offsets[routed], offsets[routed] + r)
            scale[row, 0, :r] = scales[routed]
        # Only real (non-padding) tokens when the mask matches; the others get a zero delta.
        if valid is not None and valid.shape == (rows, per_row):
            coef = scale * valid.to(torch.float32).unsqueeze(-1)
        else:
            coef = scale.expand(rows, per_row, r_max).contiguous()
        return _Plan(active, index.reshape(-1), coef)

    def to(self, device: torch.device) -> _Plan:
        if self.index.device == device:
            return self
        return _Plan(self.active, self.index.to(device), self.coef.to(device))


class _RoutingSlot:
    """Shared by every MultiLoRALinear of a LoraModel: the routing of the current forward."""

    def __init__(self) -> None:
        self.current: _Routing | None = None


class MultiLoRALinear(nn.Module):
    """A frozen linear layer plus any number of LoRA adapters, applied per batch row.

    Keeps the wrapped layer's `weight` / `bias` as its own parameters so base state-dict keys do
    not change. Different adapters may have different ranks; an adapter may skip this layer.
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
        ranks = {aid: a.shape[0] for aid, a in self.lora_A.items()}
        # Pad to the largest rank this layer holds (not the batch's): a row's padded shapes, and
        # so its kernels, do not depend on which other adapters share the batch.
        r_max = max(ranks.values())
        plan = routing.plan(x, self.in_features, ranks, self.scale, r_max)
        if plan is None:
            return y
        rows = x.shape[0]
        a_all = torch.cat([self.lora_A[a] for a in plan.active] + [self._zeros_a(x)])
        b_all = torch.cat([self.lora_B[a] for a in plan.active] + [self._zeros_b(x)], dim=1)
        a_rows = a_all.index_select(0, plan.index).view(rows, r_max, self.in_features)
        b_rows = b_all.t().index_select(0, plan.index).view(rows, r_max, self.out_features)
        # One batched matmul per side: each row multiplies only its own (padded) adapter, so its
        # result is independent of the other rows; zero padding adds exact zeros.
        x3 = x.reshape(rows, -1, self.in_features)
        h = torch.bmm(x3, a_rows.transpose(1, 2)) * plan.coef
        delta = torch.bmm(h, b_rows)
        return y + delta.to(y.dtype).view(y.shape)

    def _zeros_a(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(1, self.in_features, device=x.device, dtype=torch.float32)

    def _zeros_b(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.out_features, 1, device=x.device, dtype=torch.float32)

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
        validate_spec(spec)
        expected = {
            f"{PEFT_PREFIX}{p}.lora_{ab}.weight": p
            for p in self.target_paths(spec)
            for ab in ("A", "B")
        }
        unexpected = sorted(set(state) - set(expected))
        if not strict:
            expected = {k: p for k, p in expected.items() if p in {expected.get(s) for s in state}}
        missing = sorted(set(expected) - set(state))
        paths = list(dict.fromkeys(expected.values()))
        if missing or unexpected:
            raise ValueError(
                f"adapter keys do not match the spec: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}"
            )
        new: dict[str, tuple[nn.Parameter, nn.Parameter]] = {}
        for path in paths:
            layer = self._layers[path]
            a = state[f"{PEFT_PREFIX}{path}.lora_A.weight"]
            b = state[f"{PEFT_PREFIX}{path}.lora_B.weight"]
            if tuple(a.shape) != (spec.rank, layer.in_features) or tuple(b.shape) != (
                layer.out_features,
                spec.rank,
            ):
                raise ValueError(
                    f"{path}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit rank "
                    f"{spec.rank} and layer {layer.in_features}->{layer.out_features}"
                )
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
