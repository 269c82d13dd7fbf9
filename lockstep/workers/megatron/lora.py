"""Multi-tenant LoRA on megatron's Column/RowParallelLinear, each batch row its own adapter.

Adapters are stored per HF projection ("segment": q_proj, k_proj, v_proj of the fused
`linear_qkv`; gate_proj, up_proj of `linear_fc1`; ...), so checkpoints keep the PEFT layout.
- Column (qkv, fc1, LM head): A [r, in] replicated, B [out/tp, r] split like the output. The
  rank-r intermediate goes through `copy_to_tensor_model_parallel_region`, whose backward sums
  dL/dh over TP: A's gradient and the input's gradient are then full on every rank.
- Row (proj, fc2): A [r, in/tp] split like the input, B [out, r] replicated; the rank-r
  intermediate is summed over TP (`reduce_from_tensor_model_parallel_region`).
Activations are megatron's [seq, batch, hidden]; `RowRouting` names the adapter of each batch row.
MoE layers (Qwen3-MoE) carry their experts' adapters in `experts.LoraMoE` (split over EP ranks).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lockstep.engine.types import LoraSpec
from lockstep.modeling.experts import DOWN, GATE, UP
from lockstep.modeling.lora import PEFT_PREFIX, LoraShape, spec_targets
from lockstep.workers.megatron.convert import local_experts
from lockstep.workers.megatron.experts import ExpertLora, LoraMoE
from lockstep.workers.megatron.model import HFArch

Tensor = torch.Tensor


class _Slot:
    """Shared by every wrapper: the current forward's adapter of each batch row (`groups`:
    adapter id -> its rows), and every adapter id in sorted order (MoE tokens carry an index)."""

    def __init__(self) -> None:
        self.groups: dict[str, Tensor] = {}
        self.rows: list[str | None] = []
        self.names: list[str] = []


@dataclass(frozen=True)
class Segment:
    path: str  # HF module path, e.g. "model.layers.0.self_attn.q_proj"
    fan_in: int  # full (unsharded) sizes
    fan_out: int
    out_local: int  # this rank's share of the wrapper's output (column) or input (row)


class _LoraLinear(nn.Module):
    def __init__(
        self, base: nn.Module, slot: _Slot, segments: list[Segment], tp: int, tp_rank: int
    ) -> None:
        super().__init__()
        self.base = base
        self.segments = segments
        self.tp, self.tp_rank = tp, tp_rank
        self._slot = slot
        self.lora_A: dict[str, list[nn.Parameter]] = {}
        self.lora_B: dict[str, list[nn.Parameter]] = {}
        self.scale: dict[str, float] = {}

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        out, bias = self.base(x, *args, **kwargs)
        active = [(a, rows) for a, rows in self._slot.groups.items() if a in self.lora_A]
        for aid, rows in active:
            rows = rows.to(x.device)
            delta = self._delta(x.index_select(1, rows), aid)
            out = out.index_add(1, rows, delta.to(out.dtype))
        return out, bias

    def _delta(self, x: Tensor, aid: str) -> Tensor:
        raise NotImplementedError

    cat_dims: tuple[int | None, int | None] = (None, None)  # A / B merge dim over TP

    def shard_as(self, full: Tensor, dim: int | None) -> Tensor:
        """This rank's part of a full tensor that merges along `dim` (None: replicated)."""
        return full if dim is None else torch.chunk(full, self.tp, dim=dim)[self.tp_rank]


class ColumnLora(_LoraLinear):
    """`combine`: "concat" (fc1: [gate; up], LM head) or "qkv" (megatron's grouped layout)."""

    def __init__(
        self,
        base: nn.Module,
        slot: _Slot,
        segments: list[Segment],
        tp: int,
        tp_rank: int,
        combine: str,
        arch: HFArch,
    ) -> None:
        super().__init__(base, slot, segments, tp, tp_rank)
        self.combine = combine
        self.arch = arch
        self.gathered = bool(getattr(base, "gather_output", False))

    def _delta(self, x: Tensor, aid: str) -> Tensor:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_tensor_model_parallel_region,
        )

        parts = []
        for a, b in zip(self.lora_A[aid], self.lora_B[aid], strict=True):
            h = copy_to_tensor_model_parallel_region(torch.matmul(x, a.t()) * self.scale[aid])
            parts.append(torch.matmul(h, b.t()))
        if self.combine == "qkv":
            s, n = x.shape[0], x.shape[1]
            groups = self.arch.kv_heads // self.tp
            q, k, v = (p.reshape(s, n, groups, -1) for p in parts)
            delta = torch.cat([q, k, v], dim=-1).reshape(s, n, -1)
        else:
            delta = torch.cat(parts, dim=-1)
        return gather_from_tensor_model_parallel_region(delta) if self.gathered else delta

    cat_dims = (None, 0)  # A replicated, B split like the output


class RowLora(_LoraLinear):
    def _delta(self, x: Tensor, aid: str) -> Tensor:
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        (a,), (b,) = self.lora_A[aid], self.lora_B[aid]
        h = reduce_from_tensor_model_parallel_region(torch.matmul(x, a.t()) * self.scale[aid])
        return torch.matmul(h, b.t())

    cat_dims = (1, None)  # A split like the input, B replicated


@dataclass(frozen=True)
class ParamInfo:
    """One local adapter tensor: its PEFT key and how TP shards merge (None: replicated);
    `experts`: a 3-D expert tensor, whole over TP, this EP rank's experts along dim 0."""

    key: str
    cat_dim: int | None
    experts: bool = False


class MegatronLora:
    """Wraps one pipeline stage's linear layers; holds every tenant's local adapter shards."""

    def __init__(
        self, model: nn.Module, arch: HFArch, tp: int, tp_rank: int, ep: int = 1, ep_rank: int = 0
    ) -> None:
        self.arch = arch
        self._slot = _Slot()
        self._specs: dict[str, LoraSpec] = {}
        self._wrappers: list[_LoraLinear] = []  # model order
        self._experts: list[ExpertLora] = []  # model order
        self._expert_range = local_experts(arch, ep, ep_rank) if arch.moe else range(0)
        self._device = next(model.parameters()).device
        a = arch
        q_out, kv_out = a.heads * a.head_dim, a.kv_heads * a.head_dim
        decoder = getattr(model, "decoder", None)
        layers: Any = decoder.layers if decoder is not None else []
        for layer in layers:
            i = int(layer.layer_number) - 1  # global index, whatever the PP stage
            attn, mlp = layer.self_attention, layer.mlp
            pre = f"model.layers.{i}."

            def seg(name: str, fan_in: int, fan_out: int, local: int, pre: str = pre) -> Segment:
                return Segment(pre + name, fan_in, fan_out, local)

            attn.linear_qkv = self._add(
                ColumnLora(
                    attn.linear_qkv,
                    self._slot,
                    [
                        seg("self_attn.q_proj", a.hidden, q_out, q_out // tp),
                        seg("self_attn.k_proj", a.hidden, kv_out, kv_out // tp),
                        seg("self_attn.v_proj", a.hidden, kv_out, kv_out // tp),
                    ],
                    tp,
                    tp_rank,
                    "qkv",
                    a,
                )
            )
            attn.linear_proj = self._add(
                RowLora(
                    attn.linear_proj,
                    self._slot,
                    [seg("self_attn.o_proj", q_out, a.hidden, q_out // tp)],
                    tp,
                    tp_rank,
                )
            )
            if arch.moe:
                moe = LoraMoE(
                    mlp, self._slot, pre + "mlp.experts", a.hidden, a.moe_intermediate, tp, tp_rank
                )
                layer.mlp = moe
                self._experts += list(moe.slots.values())
                continue
            mlp.linear_fc1 = self._add(
                ColumnLora(
                    mlp.linear_fc1,
                    self._slot,
                    [
                        seg("mlp.gate_proj", a.hidden, a.intermediate, a.intermediate // tp),
                        seg("mlp.up_proj", a.hidden, a.intermediate, a.intermediate // tp),
                    ],
                    tp,
                    tp_rank,
                    "concat",
                    a,
                )
            )
            mlp.linear_fc2 = self._add(
                RowLora(
                    mlp.linear_fc2,
                    self._slot,
                    [seg("mlp.down_proj", a.intermediate, a.hidden, a.intermediate // tp)],
                    tp,
                    tp_rank,
                )
            )
        head = getattr(model, "output_layer", None)
        if head is not None and getattr(model, "post_process", False):
            model.output_layer = self._add(
                ColumnLora(
                    head,
                    self._slot,
                    [Segment("lm_head", a.hidden, a.vocab, a.vocab // tp)],
                    tp,
                    tp_rank,
                    "concat",
                    a,
                )
            )

    def _add(self, wrapper: _LoraLinear) -> _LoraLinear:
        self._wrappers.append(wrapper)
        return wrapper

    @staticmethod
    def all_paths(arch: HFArch) -> dict[str, LoraShape]:
        """Every LoRA-targetable HF path of the whole model -> (in, out), in HF model order."""
        q_out, kv_out = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
        out: dict[str, LoraShape] = {}
        for i in range(arch.layers):
            pre = f"model.layers.{i}."
            out |= {
                pre + "self_attn.q_proj": LoraShape(arch.hidden, q_out),
                pre + "self_attn.k_proj": LoraShape(arch.hidden, kv_out),
                pre + "self_attn.v_proj": LoraShape(arch.hidden, kv_out),
                pre + "self_attn.o_proj": LoraShape(q_out, arch.hidden),
            }
            if arch.moe:  # Tinker's 3-D expert adapters, in the local engine's order
                e, inter = arch.experts, arch.moe_intermediate
                out |= {
                    f"{pre}mlp.experts.{GATE}": LoraShape(arch.hidden, inter, e),
                    f"{pre}mlp.experts.{UP}": LoraShape(arch.hidden, inter, e),
                    f"{pre}mlp.experts.{DOWN}": LoraShape(inter, arch.hidden, e),
                }
                continue
            out |= {
                pre + "mlp.gate_proj": LoraShape(arch.hidden, arch.intermediate),
                pre + "mlp.up_proj": LoraShape(arch.hidden, arch.intermediate),
                pre + "mlp.down_proj": LoraShape(arch.intermediate, arch.hidden),
            }
        out["lm_head"] = LoraShape(arch.hidden, arch.vocab)
        return out

    @staticmethod
    def spec_paths(arch: HFArch, spec: LoraSpec) -> dict[str, LoraShape]:
        targets = spec_targets(spec)
        return {
            p: s for p, s in MegatronLora.all_paths(arch).items() if p.rsplit(".", 1)[-1] in targets
        }

    # -- adapters -------------------------------------------------------------------------

    def has_adapter(self, aid: str) -> bool:
        return aid in self._specs

    def load_adapter(self, aid: str, state: dict[str, Tensor], spec: LoraSpec) -> None:
        """Create or replace `aid` from a FULL PEFT state (validated by the engine); keep this
        rank's shards of the layers this stage holds."""
        targets = spec_targets(spec)
        self.remove_adapter(aid)
        for w in self._wrappers:
            if w.segments[0].path.rsplit(".", 1)[-1] not in targets:
                continue
            a_list, b_list = [], []
            for s in w.segments:
                a = w.shard_as(state[f"{PEFT_PREFIX}{s.path}.lora_A.weight"], w.cat_dims[0])
                b = w.shard_as(state[f"{PEFT_PREFIX}{s.path}.lora_B.weight"], w.cat_dims[1])
                dev = next(w.base.parameters()).device
                a_list.append(nn.Parameter(a.to(dev, torch.float32).contiguous().clone()))
                b_list.append(nn.Parameter(b.to(dev, torch.float32).contiguous().clone()))
            w.lora_A[aid], w.lora_B[aid] = a_list, b_list
            w.scale[aid] = spec.alpha / spec.rank
        mine = slice(self._expert_range.start, self._expert_range.stop)
        for x in self._experts:
            if x.path.rsplit(".", 1)[-1] not in targets:
                continue
            for ab, store in (("A", x.lora_A), ("B", x.lora_B)):
                full = state[f"{PEFT_PREFIX}{x.path}.lora_{ab}.weight"]
                store[aid] = nn.Parameter(
                    full[mine].to(self._device, torch.float32).contiguous().clone()
                )
            x.scale[aid] = spec.alpha / spec.rank
        self._specs[aid] = spec

    def remove_adapter(self, aid: str) -> None:
        self._specs.pop(aid, None)
        holders: list[_LoraLinear | ExpertLora] = [*self._wrappers, *self._experts]
        for w in holders:
            w.lora_A.pop(aid, None)
            w.lora_B.pop(aid, None)
            w.scale.pop(aid, None)

    def params(self, aid: str) -> list[tuple[nn.Parameter, ParamInfo]]:
        """This rank's tensors of `aid` (stable order) with their PEFT keys and merge rule."""
        out = []
        for w in self._wrappers:
            if aid not in w.lora_A:
                continue
            a_dim, b_dim = w.cat_dims
            for s, a, b in zip(w.segments, w.lora_A[aid], w.lora_B[aid], strict=True):
                out.append((a, ParamInfo(f"{PEFT_PREFIX}{s.path}.lora_A.weight", a_dim)))
                out.append((b, ParamInfo(f"{PEFT_PREFIX}{s.path}.lora_B.weight", b_dim)))
        for x in self._experts:
            if aid in x.lora_A:
                for ab, p in (("A", x.lora_A[aid]), ("B", x.lora_B[aid])):
                    out.append(
                        (p, ParamInfo(f"{PEFT_PREFIX}{x.path}.lora_{ab}.weight", None, True))
                    )
        return out

    @contextmanager
    def route(self, adapter_ids: Sequence[str | None]) -> Iterator[None]:
        """Batch row i uses adapter `adapter_ids[i]` (None: base only) in forwards inside."""
        groups: dict[str, list[int]] = {}
        for row, aid in enumerate(adapter_ids):
            if aid is not None:
                groups.setdefault(aid, []).append(row)
        slot = self._slot
        previous = slot.groups, slot.rows, slot.names
        slot.groups = {a: torch.tensor(r, dtype=torch.long) for a, r in groups.items()}
        slot.rows, slot.names = list(adapter_ids), sorted(self._specs)
        try:
            yield
        finally:
            slot.groups, slot.rows, slot.names = previous


def merge_experts(parts: list[list[tuple[Tensor, ParamInfo]]]) -> dict[str, Tensor]:
    """Full 3-D expert tensors from every EP rank's experts (outer list in EP-rank order)."""
    return {info.key: torch.cat([p[i][0] for p in parts]) for i, (_, info) in enumerate(parts[0])}


def merge_shards(parts: list[list[tuple[Tensor, ParamInfo]]]) -> dict[str, Tensor]:
    """Full tensors from every TP rank's shards (outer list in TP-rank order, one PP stage)."""
    merged: dict[str, Tensor] = {}
    for i, (t0, info) in enumerate(parts[0]):
        if info.cat_dim is None:
            merged[info.key] = t0
        else:
            merged[info.key] = torch.cat([p[i][0] for p in parts], dim=info.cat_dim)
    return merged
