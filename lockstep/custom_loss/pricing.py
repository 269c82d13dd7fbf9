"""Price a custom loss before it runs: its FLOPs and peak temporary memory, per datum.

The program (`program.run`, the engine's own runner) runs on meta tensors (nothing is computed
or allocated) under `_Counter`, a torch dispatch mode that sees every aten op of the forward and
of the backward (`torch.autograd.grad` of the loss w.r.t. logprobs, as the engine runs it).
Composite ops are first split into torch's core aten decompositions (pointwise ops stay whole:
their kernels allocate nothing beside their output), so what an op allocates inside (mse_loss's
broadcast difference, logsumexp's exponentials, an einsum's contraction path) is counted like
any other value:

- FLOPs: torch's formulas (`torch.utils.flop_counter`) for matrix products and attention; one
  per element of the largest operand for every other op; none for views.
- memory: each op's new storage lives from that op to the last op that reads it (saved
  tensors until the backward that uses them); the peak of their sum. The program drops a value
  after its last reader, so it holds what is counted here.

Every op is attributed to the graph node that made it (the backward through autograd's current
node), so a refusal names the node: `graph.nodes[i]`.

Shapes come in buckets: every dimension rounded up to a power of two. Sizes grow with their
inputs' dimensions in every allowed op, so a bucket's upper end prices every datum in it; a
datum is priced on its own shapes only when its bucket cannot speak for it (it fails there,
its dimensions collide there, it is over the bound there, or the graph computes sizes or
indices from shape values). Literal indices are bounds-checked at the bucket's lower end (the
smallest dimensions in it). Prices are cached per (loss, shapes): a request of thousands of
datums costs a dictionary lookup each once its buckets are priced.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch._decomp import core_aten_decompositions
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from lockstep.custom_loss import graph, program
from lockstep.custom_loss.bound import CostBound
from lockstep.custom_loss.graph import Encoding, Shapes, datum_shapes
from lockstep.custom_loss.program import NodeError, Program, Step, Value
from lockstep.engine.types import CustomLoss, Datum, Encoded
from lockstep.errors import UserInputError

PROBE_T, PROBE_K = 64, 4  # shapes a graph is priced on at creation
CACHE = 4096  # priced (loss, shapes) kept
# Composite ops split into core aten ops, so what they allocate inside is seen. Pointwise ops
# stay whole: their kernel makes nothing beside its output (and splitting them is most of the
# pricing's time). A plain dict: torch's table materialises its entries lazily (`.get` misses).
_DECOMPOSITIONS = {
    op: fn
    for op, fn in core_aten_decompositions().items()
    if torch.Tag.pointwise not in getattr(op, "tags", ())
}

# Input shapes: (shape, dtype name) per input of the loss, in its declared order.
_DTYPES = {"float32": torch.float32, "int64": torch.int64}


@dataclass(frozen=True)
class Price:
    flops: int
    peak_bytes: int
    costliest: tuple[int, str, int] | None  # (node index, node name, its FLOPs)
    peak_at: tuple[int, str] | None  # the node whose op reached the memory peak


@dataclass
class _Facts:
    """What a graph does with shapes (the same on every shape: types do not depend on sizes)."""

    exact: bool = False  # a size read from a shape reaches a size, an index or a dim
    indexes: bool = False  # it indexes a tensor with integers


class _Counter(TorchDispatchMode):
    """Counts the FLOPs and the storages of every aten op run under it (see module doc)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.step: Step | None = None
        self.owners: dict[object, Step] = {}  # autograd node -> the step whose op made it
        self.flops: dict[int, int] = {}  # step index (-1: unattributed) -> FLOPs
        self.ops: list[tuple[Step | None, list[tuple[int, int]], list[int]]] = []
        self.keep: list[torch.Tensor] = []  # every value stays referenced: storage ids unique

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: object,
        args: Sequence[object] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        decompose = _DECOMPOSITIONS.get(func)
        if decompose is not None:
            with self:  # the pieces come back through this mode
                out = decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        node = torch._C._current_autograd_node()
        step = self.step if node is None else self.owners.get(node)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        key = -1 if step is None else step.index
        self.flops[key] = self.flops.get(key, 0) + _flops(func, args, kwargs, out, ins, outs)
        new = [] if func.is_view else [(_storage(t), _nbytes(t)) for t in outs]
        if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.returns):
            new = []  # written in place: no new storage
        self.ops.append((step, new, [_storage(t) for t in ins + outs]))
        self.keep.extend(outs)
        return out

    def enter(self, step: Step) -> None:
        self.step = step

    def made(self, step: Step, out: Value) -> None:
        """Attribute the autograd nodes the step created (its backward) to it."""
        todo = [t.grad_fn for t in program.tensors(out) if t.grad_fn is not None]
        while todo:
            fn = todo.pop()
            if fn is None or fn in self.owners:
                continue
            self.owners[fn] = step
            todo.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)

    def price(self, results: Sequence[torch.Tensor]) -> Price:
        last: dict[int, int] = {}
        for k, (_, _, used) in enumerate(self.ops):
            for sid in used:
                last[sid] = k
        for t in results:  # what the program returns lives to its end
            last[_storage(t)] = len(self.ops)
        frees: dict[int, int] = {}
        live = peak = 0
        peak_step: Step | None = None
        for k, (step, new, _) in enumerate(self.ops):
            for sid, nbytes in new:
                live += nbytes
                frees[last.get(sid, k)] = frees.get(last.get(sid, k), 0) + nbytes
            if live > peak:
                peak, peak_step = live, step
            live -= frees.pop(k, 0)
        names = {s.index: s.name for s, _, _ in self.ops if s is not None}
        attributed = [(f, i) for i, f in self.flops.items() if i >= 0]
        top = max(attributed, default=None)
        return Price(
            flops=sum(self.flops.values()),
            peak_bytes=peak,
            costliest=None if top is None else (top[1], names[top[1]], top[0]),
            peak_at=None if peak_step is None else (peak_step.index, peak_step.name),
        )


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def _nbytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def _flops(
    func: OpOverload,
    args: Sequence[object],
    kwargs: Mapping[str, object],
    out: object,
    ins: list[torch.Tensor],
    outs: list[torch.Tensor],
) -> int:
    formula = flop_registry.get(func.overloadpacket)
    if formula is not None:
        return int(formula(*args, **kwargs, out_val=out))
    if func.is_view:
        return 0
    return max((t.numel() for t in ins + outs), default=0)


# ---------------------------------------------------------------- what a graph does with shapes

# Steps whose output shape does not depend on their non-tensor arguments (a scalar operand).
_SIZE_NEUTRAL = (
    frozenset(graph.ELEMENTWISE)
    | {f"torch.{n}" for n in graph.ELEMENTWISE}
    | {f"operator.{n}" for n in graph.OPERATORS if n not in ("getitem", "matmul")}
    | {"math.log", "math.exp", "math.sqrt", "torch.full_like", "masked_fill", "torch.masked_fill"}
    | {"float", "double", "long", "int", "bool", "to", "type_as", "detach", "clone"}
)
_SIZE_READS = frozenset({"size", "numel"})


class _Watch:
    """Gathers `_Facts` while a program runs (`program.run`'s `after` hook)."""

    def __init__(self) -> None:
        self.facts = _Facts()
        self.sized: set[str] = set()  # non-tensor values computed from a dimension's size

    def after(self, step: Step, out: Value) -> None:
        refs = set(program.refs([*step.args, *step.kwargs.values()]))
        is_tensor = any(True for _ in program.tensors(out))
        reads = step.target in _SIZE_READS or (step.target == "getattr" and step.args[1] == "shape")
        if not is_tensor and (reads or refs & self.sized):
            self.sized.add(step.name)
        elif refs & self.sized and step.target not in _SIZE_NEUTRAL:
            self.facts.exact = True
        if step.target == "operator.getitem" and is_tensor and _integer_index(step.args[1:]):
            self.facts.indexes = True


def _integer_index(value: Encoded | tuple[Encoded, ...]) -> bool:
    """Whether an encoded index holds an integer outside a slice (or a list of them)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    if isinstance(value, (list, tuple)):
        return any(_integer_index(v) for v in value)
    found = graph.encoded(value)
    return found is not None and found[0] is Encoding.TUPLE and _integer_index(found[1])


# ---------------------------------------------------------------- running and caching

_PRICES: OrderedDict[tuple[str, Shapes], Price | UserInputError] = OrderedDict()
_FORWARD: OrderedDict[tuple[str, Shapes], UserInputError | None] = OrderedDict()
_FACTS: OrderedDict[str, _Facts] = OrderedDict()
# (loss, bound, bucket) -> the fewest tokens a datum of the bucket needs to rely on its price.
_FEWEST: OrderedDict[tuple[str, CostBound, Shapes], int | None] = OrderedDict()


_LOCK = threading.Lock()  # the scheduler prices in threads: one at a time touches a cache


K = TypeVar("K")
V = TypeVar("V")


def _cached(cache: OrderedDict[K, V], key: K, make: Callable[[], V]) -> V:
    with _LOCK:
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
    value = make()  # outside the lock: two threads may price the same shapes once each
    with _LOCK:
        cache[key] = value
        while len(cache) > CACHE:
            cache.popitem(last=False)
    return value


def _meta(prog: Program, shapes: Shapes, grad: bool) -> dict[str, torch.Tensor]:
    names = [x.name for x in prog.loss.inputs]
    out = {
        name: torch.empty(shape, dtype=_DTYPES[dtype], device="meta")
        for name, (shape, dtype) in zip(names, shapes, strict=True)
    }
    out["logprobs"].requires_grad_(grad)
    return out


def _price(prog: Program, shapes: Shapes) -> Price | UserInputError:
    """The program's price on `shapes`, or the error it stops with (naming the node)."""
    counter, watch = _Counter(), _Watch()
    inputs = _meta(prog, shapes, grad=True)

    def after(step: Step, out: Value) -> None:
        counter.made(step, out)
        watch.after(step, out)

    try:
        with counter, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's advice on a user's graph: not for the log
            value, metrics = program.run(prog, inputs, before=counter.enter, after=after)
            counter.step = None  # what runs from here on is the loss's backward
            grads = []
            if value.requires_grad:
                grads = [
                    g
                    for g in torch.autograd.grad(value, inputs["logprobs"], allow_unused=True)
                    if g is not None
                ]
    except UserInputError as exc:
        return exc
    except RuntimeError as exc:  # an op of the backward
        return UserInputError(
            "graph", f"custom loss {prog.name!r}: its backward failed: {str(exc)[:300]}"
        )
    _cached(_FACTS, prog.loss.loss_id, lambda: watch.facts)
    return counter.price([value, *metrics.values(), *grads])


def _forward(prog: Program, shapes: Shapes) -> UserInputError | None:
    """The forward alone on `shapes` (indices checked), without counting."""
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program.run(prog, _meta(prog, shapes, grad=False))
    except UserInputError as exc:
        return exc
    return None


def priced(loss: CustomLoss, shapes: Shapes) -> Price:
    """The loss's price on `shapes` (cached).

    Raises:
        UserInputError: an op fails or is refused on these shapes, naming the node.
    """
    prog = program.program(loss)
    found = _cached(_PRICES, (loss.loss_id, shapes), lambda: _price(prog, shapes))
    if isinstance(found, UserInputError):
        raise found
    return found


def over(loss: CustomLoss, price: Price, tokens: int, bound: CostBound) -> UserInputError | None:
    """Why `price` is too much for a datum of `tokens` tokens (None: it is within the bound)."""
    if price.flops > bound.flops(tokens):
        where, name, own = price.costliest or (-1, "", 0)
        return UserInputError(
            "graph" if where < 0 else f"graph.nodes[{where}]",
            f"custom loss {loss.name!r} costs {price.flops:.3g} FLOPs (forward and backward) on "
            f"a datum of {tokens} tokens"
            + (f", {own:.3g} of them in node {name!r}" if where >= 0 else "")
            + f"; a datum's loss may cost at most {bound.flops(tokens):.3g} "
            f"({bound.flops_per_token} per token: a share of the model's own pass)",
        )
    if price.peak_bytes > bound.memory_bytes:
        where, name = price.peak_at or (-1, "")
        return UserInputError(
            "graph" if where < 0 else f"graph.nodes[{where}]",
            f"custom loss {loss.name!r} holds {price.peak_bytes / (1 << 20):.1f} MiB of "
            f"temporaries on a datum of {tokens} tokens"
            + (f", at its peak in node {name!r}" if where >= 0 else " in its backward")
            + f"; at most {bound.memory_bytes / (1 << 20):.0f} MiB",
        )
    return None


# ---------------------------------------------------------------- creation and submission


def probe_shapes(loss: CustomLoss, scale: int = 1) -> Shapes:
    dims = {0: (), 1: (PROBE_T * scale,), 2: (PROBE_T * scale, PROBE_K * scale)}
    return tuple((dims[x.rank], "float32") for x in loss.inputs)


def check_created(loss: CustomLoss, bound: CostBound, max_tokens: int) -> None:
    """The creation check beyond structure: the graph runs on probe shapes (T = 64 positions,
    K = 4 targets each), returns scalars and costs no more than the bound for a 64-token datum.
    An index out of range there is tried on larger shapes (doubling, up to `max_tokens`
    positions): refused only if no datum the server accepts could hold it.

    Raises:
        UserInputError: naming the node (`graph.nodes[i]`).
    """
    scale = 1
    while True:
        shapes = probe_shapes(loss, scale)
        try:
            price = priced(loss, shapes)
        except NodeError as exc:
            if not exc.out_of_range or PROBE_T * scale * 2 > max_tokens:
                raise
            scale *= 2
            continue
        refused = over(loss, price, PROBE_T * scale, bound)
        if refused is not None:
            raise refused
        return


@functools.cache
def _round(n: int, up: bool) -> int:
    if n <= 2:
        return n
    top = 1 << (n - 1).bit_length()
    return top if up else top // 2 + 1


def bucket(shapes: Shapes, up: bool) -> Shapes | None:
    """Every dimension rounded to its power-of-two bucket's upper (or lower) end; None when two
    different dimensions of the datum fall in one bucket (the bucket would make them equal)."""
    dims = {d for shape, _ in shapes for d in shape}
    if len({_round(d, True) for d in dims}) != len(dims):
        return None
    return tuple((tuple(_round(d, up) for d in shape), dtype) for shape, dtype in shapes)


def _fewest_tokens(loss: CustomLoss, high: Shapes, bound: CostBound, facts: _Facts) -> int | None:
    """The fewest tokens a datum in this bucket needs for the bucket's price to be within the
    bound (None: no datum of the bucket can rely on the bucket)."""
    try:
        price = priced(loss, high)
    except UserInputError:
        return None
    if price.peak_bytes > bound.memory_bytes:
        return None
    fewest = max(1, -(-price.flops // bound.flops_per_token))
    if facts.indexes:  # integer indices must be in range on the bucket's smallest shapes too
        low = bucket(high, up=False)
        assert low is not None, "a bucket's dimensions are distinct"
        prog = program.program(loss)
        if _cached(_FORWARD, (loss.loss_id, low), lambda: _forward(prog, low)) is not None:
            return None
    return fewest


def check_price(loss: CustomLoss, shapes: Shapes, tokens: int, bound: CostBound) -> None:
    """One datum's loss within the bound on its shapes (its bucket's price when that speaks for
    it, else its own).

    Raises:
        UserInputError: naming the node (`graph.nodes[i]`).
    """
    facts = _FACTS.get(loss.loss_id)
    high = bucket(shapes, up=True) if facts is not None and not facts.exact else None
    if facts is not None and high is not None:
        key = (loss.loss_id, bound, high)
        fewest = _cached(_FEWEST, key, lambda: _fewest_tokens(loss, high, bound, facts))
        if fewest is not None and tokens >= fewest:
            return
    refused = over(loss, priced(loss, shapes), tokens, bound)
    if refused is not None:
        raise refused


def check_shapes(loss: CustomLoss, shapes: Sequence[tuple[Shapes, int]], bound: CostBound) -> None:
    """`check_price` on each datum of a request, given as (its shapes, its tokens); the error
    names the datum and the node."""
    for i, (datum, tokens) in enumerate(shapes):
        try:
            check_price(loss, datum, tokens, bound)
        except UserInputError as exc:
            raise UserInputError(f"data[{i}]", str(exc)) from None


def check_data(loss: CustomLoss, data: Sequence[Datum], bound: CostBound) -> None:
    """`check_shapes` on a request's datums."""
    check_shapes(loss, [(datum_shapes(loss, d), len(d.tokens)) for d in data], bound)
