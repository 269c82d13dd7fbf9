"""A census of the aten ops a model's forward and backward dispatch, by decoder layer.

`OpCensus(model)` is entered around the work to count (a packed cycle of the trainer,
`workers.local.cycle_census`). Every aten op is counted as it reaches the backend, below
autograd and after composite ops are decomposed (a TorchDispatchMode): what a device runs.

Where an op is counted (its `Place`: region, decoder layer, part of the layer):
- forward: the caller names the regions of its work (`region`); inside the model, the ops
  before the first decoder layer are the embedding's, each layer's forward (wrapped, as
  activation checkpointing wraps it) its own, and everything after the last layer the head's
  (final norm, LM head, per-row loss). Inside a layer, forward hooks on its children name the
  part: attention, recurrent mixer, feed-forward (what each child is, `decoder_layers`); norms and
  residual adds are the layer's "other".
- backward: each autograd node the forward creates is stamped with the place that created it (a
  TorchFunctionMode walks the new nodes behind every torch call's outputs), and an op run in
  backward counts where its node was stamped (`torch._C._current_autograd_node()`). Ops that
  accumulate a gradient into a parameter (autograd's AccumulateGrad) count apart, in region
  `grad_accumulate`: one per adapter tensor by nature.

What an op is (`Kind`): a view or other metadata-only op (its schema returns an alias), an
allocation (`empty*`: no kernel), a host read (`_local_scalar_dense`, `.tolist()`, `.numpy()`:
a device sync on a GPU when the tensor lives there), or a kernel. A `_foreach_*` op counts one
kernel where CUDA's multi-tensor path takes it (every list's i-th tensors of one size and
stride, each list of one dtype, all contiguous) and one per tensor where CUDA falls back to a
loop. Casts: `_to_copy` / `copy_` / `_foreach_copy_` whose output dtype differs from its input's,
in bytes written, with their source (the calling line in Lockstep or transformers; for backward,
the node and the line that made it). Grouped GEMMs: each `_grouped_mm` call's group count.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from types import TracebackType
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import PreTrainedModel

from lockstep.modeling.decoder_layers import decoder_layers, is_recurrent
from lockstep.modeling.experts import MultiLoRAExperts


class Region(StrEnum):
    PASS = "pass"  # the caller's work outside the model (packing, gradient bookkeeping)
    EMBED = "embed"
    LAYER = "layer"
    HEAD = "head_loss"
    GRADS = "grad_accumulate"
    OPTIMIZER = "optimizer"


class Kind(StrEnum):
    KERNEL = "kernel"
    VIEW = "view"
    ALLOC = "alloc"
    HOST_READ = "host_read"


class Place(NamedTuple):
    region: Region
    layer: int | None = None
    part: str | None = None  # a layer's child: attention / recurrent / feed_forward; None: other


@dataclass
class Op:
    place: Place
    name: str
    kind: Kind
    kernels: int  # kernels it launches on CUDA (a _foreach_ op that falls back: one per tensor)
    cast_bytes: int = 0
    cast: str = ""  # "float32->bfloat16"
    source: str = ""  # where a cast comes from
    groups: int = 0  # a grouped GEMM's group count


_ALLOC = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
_HOST_READS = frozenset({"_local_scalar_dense"})
_CASTS = frozenset({"_to_copy", "copy_", "copy", "_foreach_copy_"})
GEMMS = frozenset({"mm", "bmm", "addmm", "addmm_", "baddbmm", "addbmm", "_grouped_mm"})
_HERE = __file__.rsplit("/", 1)[-1]


class OpCensus(TorchDispatchMode):
    """Counts every aten op run inside it, each at its `Place` (module docstring)."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.ops: list[Op] = []
        self.place = Place(Region.PASS)
        self._model = model
        self._layers = decoder_layers(model)
        self.layer_kinds: list[str] = []
        self._owners: dict[object, tuple[Place, str]] = {}  # autograd node -> (place, source)
        self.unattributed = 0  # backward ops of nodes no stamp reached (counted where we are)
        self.forwards = 0  # the model's forwards (one per micro-batch)
        self._stamps = _Stamps(self)
        self._hooks = ExitStack()

    # -- attribution ------------------------------------------------------------------------

    def __enter__(self) -> OpCensus:
        self._hooks.__enter__()
        self._hooks.enter_context(self._attach())
        self._hooks.enter_context(self._stamps)
        super().__enter__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        super().__exit__(kind, exc, tb)  # type: ignore[no-untyped-call]
        self._hooks.__exit__(kind, exc, tb)

    def region(self, region: Region) -> AbstractContextManager[None]:
        """Count the ops run inside as `region`'s (outside the model's own places)."""
        return self._at(Place(region))

    @contextmanager
    def _at(self, place: Place) -> Iterator[None]:
        before, self.place = self.place, place
        try:
            yield
        finally:
            self.place = before

    @contextmanager
    def _attach(self) -> Iterator[None]:
        """Wrap each decoder layer's forward and hook its children for the census's lifetime."""
        decoder = self._model.get_decoder()
        handles = [decoder.register_forward_pre_hook(self._forward_starts)]
        wrapped: list[tuple[nn.Module, Callable[..., object] | None]] = []
        self.layer_kinds = []
        for index, layer in enumerate(self._layers):
            wrapped.append((layer, layer.__dict__.get("forward")))
            layer.forward = self._wrapped(index, layer.forward)
            kinds = []
            for child in layer.children():
                part = _part(child)
                if part is None:
                    continue
                moe = any(isinstance(m, MultiLoRAExperts) for m in child.modules())
                kinds.append("moe" if part == "feed_forward" and moe else part)
                handles.append(child.register_forward_pre_hook(self._enter_part(index, part)))
                handles.append(child.register_forward_hook(self._leave_part(index)))
            self.layer_kinds.append("+".join(kinds) or "other")
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for layer, forward in wrapped:
                if forward is None:
                    del layer.forward
                else:
                    layer.forward = forward

    def _forward_starts(self, *_: object) -> None:
        self.forwards += 1
        self.place = Place(Region.EMBED)

    def _wrapped(self, index: int, forward: Callable[..., object]) -> Callable[..., object]:
        last = len(self._layers) - 1

        def run(*args: object, **kwargs: object) -> object:
            self.place = Place(Region.LAYER, index)
            try:
                return forward(*args, **kwargs)
            finally:
                self.place = Place(Region.HEAD) if index == last else Place(Region.LAYER, index)

        return run

    def _enter_part(self, index: int, part: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            self.place = Place(Region.LAYER, index, part)

        return hook

    def _leave_part(self, index: int) -> Callable[..., None]:
        def hook(*_: object) -> None:
            self.place = Place(Region.LAYER, index)

        return hook

    def stamp(self, out: object, source: str) -> None:
        """Attribute the autograd nodes behind `out` not yet seen to the current place."""
        todo = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        while todo:
            node = todo.pop()
            if node is None or node in self._owners:
                continue
            self._owners[node] = (self.place, source)
            todo.extend(n for n, _ in node.next_functions)

    # -- counting ---------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        node = torch._C._current_autograd_node()
        place, source = self.place, ""
        if node is not None:  # backward: where the node was made
            owner = self._owners.get(node)
            if owner is None:
                self.unattributed += 1
            place, made = owner or (self.place, "?")
            source = f"{node.name()} of {made}"
            if "AccumulateGrad" in node.name():
                place = Place(Region.GRADS, place.layer)
        kind = _kind(func, name)
        op = Op(place, name, kind, _kernels(name, args) if kind is Kind.KERNEL else 0)
        if name == "_grouped_mm":
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            op.groups = 0 if offs is None else int(offs.shape[0])
        if name in _CASTS:
            op.cast_bytes, op.cast = _cast(name, args, out)
        if op.cast_bytes or op.kind is Kind.HOST_READ:
            op.source = source or _caller()
        self.ops.append(op)
        return out

    def host_read(self, name: str) -> None:
        """A host read torch does not dispatch (`.tolist()`, `.numpy()`)."""
        self.ops.append(Op(self.place, name, Kind.HOST_READ, 0, source=_caller()))

    # -- results ----------------------------------------------------------------------------

    def summary(self, tokens: int) -> dict[str, Any]:
        """The counts of everything run inside: per decoder layer, per region, casts, groups."""
        layers = [_Tally() for _ in self._layers]
        regions: dict[str, _Tally] = {r.value: _Tally() for r in Region}
        for op in self.ops:
            regions[op.place.region].add(op)
            if op.place.region is Region.LAYER and op.place.layer is not None:
                layers[op.place.layer].add(op)
        n = max(1, len(layers))
        casts = Counter[str]()
        in_layers = Counter[str]()
        pairs = Counter[str]()
        for op in self.ops:
            if op.cast_bytes:
                casts[op.source] += op.cast_bytes
                pairs[op.cast] += op.cast_bytes
                if op.place.region is Region.LAYER:
                    in_layers[op.source] += op.cast_bytes
        cast_bytes = sum(casts.values())
        grouped = [op.groups for op in self.ops if op.name == "_grouped_mm"]
        reads = Counter(
            f"{op.name} at {op.source}"
            for op in self.ops
            if op.kind is Kind.HOST_READ and op.place.region is Region.LAYER
        )
        return {
            "ops_per_layer": round(sum(t.kernels for t in layers) / n, 1),
            "cast_bytes": cast_bytes,
            "max_groups": max(grouped, default=0),
            "tokens": tokens,
            "cast_bytes_per_token": round(cast_bytes / max(1, tokens), 1),
            "all_ops_per_layer": round(sum(t.ops for t in layers) / n, 1),
            "view_ops_per_layer": round(sum(t.kinds[Kind.VIEW] for t in layers) / n, 1),
            "host_reads_per_layer": round(sum(t.kinds[Kind.HOST_READ] for t in layers) / n, 1),
            "cast_bytes_per_layer": round(sum(t.cast_bytes for t in layers) / n),
            "kernel_ops": sum(t.kernels for t in regions.values()),
            "all_ops": len(self.ops),
            "grouped_mm_calls": len(grouped),
            "gemm_calls": sum(1 for op in self.ops if op.name in GEMMS),
            # forward attention kernels: one varlen call per packed sequence, or SDPA per row
            "attention_calls": {
                "varlen": sum(1 for op in self.ops if op.name == "varlen_attn"),
                "sdpa": sum(
                    1
                    for op in self.ops
                    if op.name.startswith("_scaled_dot_product") and "backward" not in op.name
                ),
            },
            "regions": {name: t.brief() for name, t in regions.items()},
            "layers": [
                {"kind": kind, **t.brief(), "parts": dict(t.parts)}
                for kind, t in zip(self.layer_kinds, layers, strict=True)
            ],
            "cast_bytes_by_dtype": dict(pairs.most_common()),
            "cast_top_sources": _top(casts, cast_bytes),
            "layer_cast_top_sources": _top(in_layers, cast_bytes),
            "layer_host_reads": dict(reads.most_common(6)),
            "micro_batches": self.forwards,
            "unattributed_backward_ops": self.unattributed,
        }


@dataclass
class _Tally:
    ops: int = 0
    kernels: int = 0
    cast_bytes: int = 0
    kinds: Counter[Kind] = field(default_factory=Counter)
    parts: Counter[str] = field(default_factory=Counter)  # kernels per part of a layer

    def add(self, op: Op) -> None:
        self.ops += 1
        self.kernels += op.kernels
        self.cast_bytes += op.cast_bytes
        self.kinds[op.kind] += 1
        if op.kernels:
            self.parts[op.place.part or "other"] += op.kernels

    def brief(self) -> dict[str, int]:
        return {
            "kernel_ops": self.kernels,
            "all_ops": self.ops,
            "host_reads": self.kinds[Kind.HOST_READ],
            "cast_bytes": self.cast_bytes,
        }


class _Stamps(TorchFunctionMode):
    """Stamps the autograd nodes behind each torch call's outputs with the census's current
    place and the calling line (`OpCensus.stamp`); counts host reads torch does not dispatch."""

    def __init__(self, census: OpCensus) -> None:
        super().__init__()
        self._census = census

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name in ("tolist", "numpy"):
            self._census.host_read(name)
        elif torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.grad_fn is not None for t in tree_leaves(out)
        ):
            self._census.stamp(out, _caller())
        return out


def _top(sources: Counter[str], total: int, n: int = 8) -> list[dict[str, Any]]:
    """The `n` sources that cast the most bytes, with their share of all `total` bytes cast."""
    return [
        {"source": s, "bytes": b, "share": round(b / max(1, total), 3)}
        for s, b in sources.most_common(n)
    ]


def _part(child: nn.Module) -> str | None:
    """What a decoder layer's child is, after the LoRA layers took the linear layers' places
    (`decoder_layers` reads the loaded model; here its linear layers are `MultiLoRALinear`)."""
    if is_recurrent(child):
        return "recurrent"
    if any(hasattr(child, q) for q in ("q_proj", "q_a_proj", "q_b_proj")) and hasattr(
        child, "o_proj"
    ):
        return "attention"
    if any(isinstance(m, MultiLoRAExperts) for m in child.modules()) or hasattr(child, "down_proj"):
        return "feed_forward"
    return None


def _kind(func: Any, name: str) -> Kind:
    if name in _HOST_READS:
        return Kind.HOST_READ
    if name in _ALLOC:
        return Kind.ALLOC
    if func.is_view or name in ("_unsafe_view", "lift_fresh", "detach", "alias"):
        return Kind.VIEW
    returns = func._schema.returns
    if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return Kind.VIEW  # split, unbind, ...: views of their input
    return Kind.KERNEL


def _kernels(name: str, args: Any) -> int:
    """Kernels a kernel op launches on CUDA: one, or for a `_foreach_` op that CUDA cannot run
    as one multi-tensor kernel, one per tensor."""
    if not name.startswith("_foreach_"):
        return 1
    lists = [a for a in args if isinstance(a, list | tuple) and a]
    lists = [a for a in lists if all(isinstance(t, torch.Tensor) for t in a)]
    if not lists:
        return 1
    fast = all(t.is_contiguous() for ts in lists for t in ts)
    fast = fast and all(len({t.dtype for t in ts}) == 1 for ts in lists)
    fast = fast and all(
        len({(tuple(ts[i].shape), ts[i].stride()) for ts in lists}) == 1
        for i in range(len(lists[0]))
    )
    return 1 if fast else len(lists[0])


def _cast(name: str, args: Any, out: Any) -> tuple[int, str]:
    """(bytes written, "src->dst") of a dtype-changing copy; (0, "") for a same-dtype one."""
    if name == "_foreach_copy_":
        pairs = [(d, s) for d, s in zip(args[0], args[1], strict=True) if d.dtype != s.dtype]
    elif name == "_to_copy":
        pairs = [(out, args[0])] if out.dtype != args[0].dtype else []
    else:  # copy_(dst, src) / copy(dst, src)
        pairs = [(out, args[1])] if out.dtype != args[1].dtype else []
    if not pairs:
        return 0, ""
    dst, src = pairs[0]
    label = f"{str(src.dtype).removeprefix('torch.')}->{str(dst.dtype).removeprefix('torch.')}"
    return sum(d.numel() * d.element_size() for d, _ in pairs), label


def _caller() -> str:
    """The innermost calling line in Lockstep or transformers ("lockstep/x.py:12 f")."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        for root in ("/lockstep/", "/transformers/"):
            at = path.rfind(root)
            if at >= 0 and not path.endswith(_HERE):
                where = path[at + 1 :]
                return f"{where}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"
