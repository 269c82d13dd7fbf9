"""Custom losses rebuilt from the allowlist and run per datum, with autograd.

`rebuild(loss)` turns a stored graph (checked by `graph.build_loss`) into a program whose every
step is a callable from the fixed tables below, keyed by the same names: a node's target is only
ever a key into these tables, never imported, looked up on a module or evaluated.

`run` executes the steps. It is the one runner: the engine runs it on a datum's real tensors
(`evaluate`), `pricing.py` on meta tensors under its FLOP and memory counter. Indexing is
checked against the indexed tensor's real shape on the host before the op is launched, so an
out-of-range index is this datum's error, never a device-side assert that would take the
engine (and every tenant on it) down. A value is dropped after its last use, so what the
program holds is what the pricing counted.
"""

from __future__ import annotations

import math
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from lockstep.custom_loss import graph
from lockstep.custom_loss.graph import Encoding
from lockstep.engine.interface import is_device_error
from lockstep.engine.types import CustomLoss, Datum, Encoded
from lockstep.errors import UserInputError

# A value a step takes or makes: a tensor, a size or a number, a dtype, a slice, a container of
# them. Steps narrow what they are given (`isinstance`), never trust it.
Value = object
Fn = Callable[..., Value]  # a step's callable: a torch function or method, or a guard below


# torch's object of each name the graph's vocabulary allows (`graph.DTYPES`, `graph.CONSTANTS`).
_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in graph.DTYPES}
_CONSTANTS: dict[Encoding, dict[str, Value]] = {
    kind: {name: getattr(torch, name) for name in names} for kind, names in graph.CONSTANTS.items()
}
_PLACED = frozenset({"torch.zeros", "torch.ones", "torch.full", "torch.arange"})


class Refused(Exception):
    """A step refused on its arguments (not a torch error)."""


class NodeError(UserInputError):
    """A node's op failed or was refused; its field is `graph.nodes[i]`."""

    def __init__(self, field: str, message: str, out_of_range: bool = False) -> None:
        super().__init__(field, message)
        self.out_of_range = out_of_range  # an index past the end of its dimension


class IndexOutOfRange(Refused):
    """A literal or computed index past the end of the dimension it indexes."""


def _attribute(x: Value, name: Value) -> Value:
    if not isinstance(x, torch.Tensor) or name not in graph.ALLOWED_ATTRIBUTES:
        raise Refused(f"attribute {name!r} of a {type(x).__name__}")
    getters: dict[Value, Callable[[], Value]] = {
        "shape": lambda: x.shape,
        "ndim": lambda: x.ndim,
        "dtype": lambda: x.dtype,
        "T": lambda: x.T,
        "mT": lambda: x.mT,
    }
    return getters[name]()


def _to(x: Value, target: Value, *args: Value, **kwargs: Value) -> Value:
    """`.to` for dtypes only (a tensor argument gives its dtype): never another device."""
    if not isinstance(x, torch.Tensor):
        raise Refused(".to() of a non-tensor")
    if args or kwargs or not isinstance(target, (torch.dtype, torch.Tensor)):
        raise Refused(".to() takes only a dtype here")
    return x.to(target if isinstance(target, torch.dtype) else target.dtype)


def _index_values(item: Value) -> Iterator[Value]:
    """The scalar indices of one advanced index (a list or tuple, nested)."""
    if isinstance(item, (list, tuple)):
        for value in item:
            yield from _index_values(value)
    else:
        yield item


def check_index(x: torch.Tensor, index: Value) -> None:
    """Every integer in `x[index]` within the dimension it indexes (checked on the host from
    the shape alone: nothing is read from the device).

    Raises:
        IndexOutOfRange: naming the index, the dimension and its size.
        Refused: a boolean index (its result's shape depends on values).
    """
    items = index if isinstance(index, tuple) else (index,)
    plain = [i for i in items if i is not None and i is not Ellipsis]
    dim = 0
    for item in items:
        if item is Ellipsis:
            dim += x.ndim - len(plain)
            continue
        if item is None or isinstance(item, slice):
            dim += item is not None
            continue
        values = list(_index_values(item))
        if any(isinstance(v, bool) for v in values):
            raise Refused("boolean indices are not allowed (the result's shape depends on values)")
        if dim >= x.ndim:
            raise IndexOutOfRange(f"too many indices for a tensor of shape {tuple(x.shape)}")
        size = x.shape[dim]
        for v in values:
            if isinstance(v, int) and not -size <= v < size:
                raise IndexOutOfRange(
                    f"index {v} is out of range for dimension {dim} of size {size} (shape "
                    f"{tuple(x.shape)})"
                )
        dim += 1


def _has_tensor(index: Value) -> bool:
    if isinstance(index, slice):
        return any(_has_tensor(v) for v in (index.start, index.stop, index.step))
    if isinstance(index, (list, tuple)):
        return any(_has_tensor(v) for v in index)
    return isinstance(index, torch.Tensor)


def _getitem(x: Value, index: Value) -> Value:
    if isinstance(x, torch.Tensor):
        if _has_tensor(index):  # a value read back from the device, or a gather
            raise Refused("indexing with tensors is not allowed")
        check_index(x, index)
        return x[index]  # type: ignore[index]  # what check_index let through is an index
    if not isinstance(x, (tuple, torch.Size)) or not isinstance(index, (int, slice)):
        raise Refused("indexing a non-tensor")
    return x[index]


def _python_op(fn: Fn) -> Fn:
    """An operator: on tensors as torch has it; on plain Python values (sizes) numbers only,
    results bounded, so no graph builds a huge int, string or list on the host."""

    def call(*args: Value) -> Value:
        if any(isinstance(a, torch.Tensor) for a in args):
            return fn(*args)
        if not all(isinstance(a, (int, float, bool)) for a in args):
            raise Refused(f"{fn.__name__} on {[type(a).__name__ for a in args]}")
        if fn is operator.pow and isinstance(args[1], int) and abs(args[1]) > 64:
            raise Refused("integer power above 64")
        out = fn(*args)
        if isinstance(out, int) and abs(out) >= 2**63:
            raise Refused("integer result out of range")
        return out

    return call


def _tables() -> dict[str, Fn]:
    """Function targets -> callables, from the allowlist's own names (constants, not input)."""
    table: dict[str, Fn] = {}
    for name in graph.ALLOWED_FUNCTIONS:
        module, _, attr = name.rpartition(".")
        if module == "torch":
            table[name] = getattr(torch, attr)
        elif module == "operator":
            table[name] = _python_op(getattr(operator, attr))
    table.update(
        {
            "operator.getitem": _getitem,
            "torch._C._nn.log_sigmoid": F.logsigmoid,
            "torch._C._nn.softplus": F.softplus,
            "torch.nn.functional.logsigmoid": F.logsigmoid,
            "torch.nn.functional.log_softmax": F.log_softmax,
            "torch.nn.functional.softmax": F.softmax,
            "torch.nn.functional.relu": F.relu,
            "torch.nn.functional.softplus": F.softplus,
            "torch.nn.functional.mse_loss": F.mse_loss,
            "torch.nn.functional.binary_cross_entropy_with_logits": (
                F.binary_cross_entropy_with_logits
            ),
            "torch.functional.einsum": torch.einsum,
            "math.log": _python_op(math.log),
            "math.exp": _python_op(math.exp),
            "math.sqrt": _python_op(math.sqrt),
            "getattr": _attribute,
        }
    )
    return table


FUNCTIONS: dict[str, Fn] = _tables()
METHODS: dict[str, Fn] = {
    name: getattr(torch.Tensor, name) for name in graph.ALLOWED_METHODS if name != "to"
} | {"to": _to}
assert set(FUNCTIONS) == graph.ALLOWED_FUNCTIONS, "the torch table and the allowlist must agree"
assert set(METHODS) == graph.ALLOWED_METHODS, "the torch table and the allowlist must agree"


@dataclass(frozen=True)
class Step:
    index: int  # in the graph's nodes: errors name `graph.nodes[index]`
    name: str
    target: str
    fn: Fn
    args: tuple[Encoded, ...]
    kwargs: dict[str, Encoded]
    done_with: tuple[str, ...]  # values no later step (nor the output) reads: dropped after it

    @property
    def where(self) -> str:
        return f"graph.nodes[{self.index}]"

    def refuse(self, message: str, out_of_range: bool = False) -> NodeError:
        return NodeError(self.where, f"node {self.name!r} ({self.target}) {message}", out_of_range)


@dataclass(frozen=True)
class Program:
    """A rebuilt loss: steps in order and where the outputs are."""

    loss: CustomLoss
    steps: tuple[Step, ...]
    output: Encoded  # (loss, metrics)

    @property
    def name(self) -> str:
        return self.loss.name


def refs(value: Encoded) -> Iterator[str]:
    found = graph.encoded(value)
    if isinstance(value, list):
        for v in value:
            yield from refs(v)
    elif found is not None:
        kind, inner = found
        if kind is Encoding.REF and isinstance(inner, str):
            yield inner
        elif kind in (Encoding.TUPLE, Encoding.SLICE):
            yield from refs(inner)
        elif kind is Encoding.DICT and isinstance(inner, dict):
            yield from refs(list(inner.values()))


def rebuild(loss: CustomLoss) -> Program:
    nodes = loss.nodes
    last: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for ref in refs([*node.args, *node.kwargs.values()]):
            last[ref] = i
    steps = []
    for i, node in enumerate(nodes):
        if node.op == graph.NodeOp.CALL_FUNCTION:
            fn = FUNCTIONS[node.target]
        elif node.op == graph.NodeOp.CALL_METHOD:
            fn = METHODS[node.target]
        else:
            continue
        done = tuple(ref for ref, at in last.items() if at == i)
        steps.append(Step(i, node.name, node.target, fn, node.args, dict(node.kwargs), done))
    return Program(loss, tuple(steps), nodes[-1].args[0])


_PROGRAMS: OrderedDict[str, Program] = OrderedDict()
_LOCK = threading.Lock()  # the scheduler checks losses in threads


def program(loss: CustomLoss) -> Program:
    """The rebuilt loss, cached by id (a stored loss never changes)."""
    with _LOCK:
        found = _PROGRAMS.get(loss.loss_id)
        if found is None or found.loss != loss:
            found = _PROGRAMS[loss.loss_id] = rebuild(loss)
        _PROGRAMS.move_to_end(loss.loss_id)
        while len(_PROGRAMS) > 256:
            _PROGRAMS.popitem(last=False)
        return found


def _decode(value: Encoded, env: dict[str, Value], device: torch.device) -> Value:
    """An argument's value (its encoding was checked at creation, `graph._ENCODINGS`)."""
    if isinstance(value, list):
        return [_decode(v, env, device) for v in value]
    found = graph.encoded(value)
    if found is None:
        return value
    kind, inner = found
    items = inner if isinstance(inner, list) else []
    if kind is Encoding.REF:
        return env[str(inner)]
    if kind is Encoding.TUPLE:
        return tuple(_decode(v, env, device) for v in items)
    if kind is Encoding.DICT:
        assert isinstance(inner, dict)
        return {k: _decode(v, env, device) for k, v in inner.items()}
    if kind is Encoding.SLICE:
        return slice(*(_decode(v, env, device) for v in items))
    if kind is Encoding.ELLIPSIS:
        return Ellipsis
    if kind is Encoding.FLOAT:
        return graph.decode_float(inner)
    if kind is Encoding.DTYPE:
        return _DTYPES[str(inner)]
    if kind is Encoding.DEVICE:
        return device  # a graph never picks a device: values live on the engine's
    return _CONSTANTS[kind][str(inner)]


def tensors(value: Value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors(v)


class StepHook(Protocol):
    """What sees each step's output (the pricing counter's attribution)."""

    def __call__(self, step: Step, out: Value) -> None: ...


def run(
    prog: Program,
    inputs: dict[str, torch.Tensor],
    before: Callable[[Step], None] | None = None,
    after: StepHook | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run the steps on `inputs` (`logprobs` and the loss's other inputs); `before`/`after` see
    each step (the pricing counter's attribution).

    Raises:
        UserInputError: naming the node (`graph.nodes[i]`) whose op failed or was refused, or
            the output that is not a scalar float.
        torch.OutOfMemoryError, or a device error (`is_device_error`): raised as they are; an
            out-of-memory error is the pass's to retry in smaller pieces, a device error ends
            the engine.
    """
    device = inputs["logprobs"].device
    env: dict[str, Value] = dict(inputs)
    for step in prog.steps:
        args = [_decode(v, env, device) for v in step.args]
        kwargs = {k: _decode(v, env, device) for k, v in step.kwargs.items()}
        if step.target in _PLACED:
            kwargs["device"] = device
        if before is not None:
            before(step)
        try:
            out = step.fn(*args, **kwargs)
        except IndexOutOfRange as exc:
            raise step.refuse(f"is not allowed: {exc}", out_of_range=True) from None
        except Refused as exc:
            raise step.refuse(f"is not allowed: {exc}") from None
        except NotImplementedError as exc:  # what meta tensors say of value-dependent shapes
            raise step.refuse(f"has a shape that depends on values ({str(exc)[:200]})") from None
        except Exception as exc:  # an op's own error is the graph's fault: a 400, never a 500
            if isinstance(exc, torch.OutOfMemoryError) or is_device_error(exc):
                raise
            raise step.refuse(f"failed: {type(exc).__name__}: {str(exc)[:300]}") from None
        if after is not None:
            after(step, out)
        env[step.name] = out
        for name in step.done_with:  # its last reader ran: the value can go
            env.pop(name, None)
    output = _decode(prog.output, env, device)
    assert isinstance(output, (tuple, list)) and len(output) == 2  # checked at creation
    loss, metrics = output
    assert isinstance(metrics, dict)
    return _scalar(prog, "the loss", loss), {
        str(key): _scalar(prog, f"metric {key!r}", value) for key, value in metrics.items()
    }


def _scalar(prog: Program, what: str, value: Value) -> torch.Tensor:
    """`value` if it is a scalar float tensor; else the graph's error."""
    if not isinstance(value, torch.Tensor) or value.ndim != 0:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise UserInputError(
            "graph", f"custom loss {prog.name!r}: {what} must be a scalar tensor, got {shape}"
        )
    if not value.is_floating_point():
        raise UserInputError("graph", f"custom loss {prog.name!r}: {what} must be a float tensor")
    return value


def datum_inputs(loss: CustomLoss, datum: Datum, device: torch.device) -> dict[str, torch.Tensor]:
    """The loss_fn_inputs a loss reads as tensors (float32 or int64, as the wire sent them);
    a rank-0 input is a scalar."""
    out = {}
    for x in loss.inputs[1:]:
        value = np.asarray(datum.loss_inputs[x.name])
        tensor = torch.as_tensor(value, device=device)
        out[x.name] = tensor.reshape(()) if x.rank == 0 else tensor
    return out


def evaluate(
    loss: CustomLoss, logp: torch.Tensor, datum: Datum
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(scalar loss, scalar metrics) of one datum from its target logprobs (shape of
    target_tokens), differentiable in `logp`. The datum was checked and priced at submission.

    Raises:
        UserInputError: an op fails or is refused, or the loss is NaN or inf.
    """
    inputs = {"logprobs": logp, **datum_inputs(loss, datum, logp.device)}
    value, metrics = run(program(loss), inputs)
    check_finite(loss, "loss", value)
    return value, metrics


def check_finite(loss: CustomLoss, what: str, value: torch.Tensor) -> None:
    """A NaN or inf loss (or gradient) fails the datum's request: nothing of it is applied."""
    if not bool(torch.isfinite(value.detach()).all()):
        shown = float(value.detach()) if value.ndim == 0 else "not finite"
        raise UserInputError(
            "loss_fn_config.loss_id",
            f"custom loss {loss.name!r}: its {what} is {shown} on this request's data; nothing "
            "was applied",
        )
