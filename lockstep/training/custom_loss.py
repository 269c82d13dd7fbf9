"""Custom losses rebuilt from the allowlist and run per datum, with autograd.

`rebuild(loss)` turns a stored graph (validated by `lockstep.engine.custom_loss`) into a program
whose every step is a callable from the fixed tables below, keyed by the same names: a node's
target is only ever a key into these tables, never imported, looked up on a module or evaluated.

Before a datum runs for real, `dry_run` runs the program on meta tensors of the datum's shapes
(nothing is computed or allocated): every value's size is checked against the limits, the loss
and the metrics must be scalars, and ops whose shape depends on values are refused. The
scheduler runs it at creation (on probe shapes) and at submission (on each datum's shapes), so a
bad graph is a 400 before it is queued; the engine runs it again (cached) before it computes.
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lockstep.engine import custom_loss as spec
from lockstep.engine.types import CustomLoss, Datum
from lockstep.errors import UserInputError

Fn = Callable[..., Any]
PROBE_T, PROBE_K = 64, 4  # shapes a graph is checked on at creation

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "bool": torch.bool,
}
_CONSTANTS: dict[str, dict[str, Any]] = {
    "layout": {"strided": torch.strided},
    "memory_format": {
        "contiguous_format": torch.contiguous_format,
        "preserve_format": torch.preserve_format,
    },
}
_PLACED = frozenset({"torch.zeros", "torch.ones", "torch.full", "torch.arange"})


class _Refused(Exception):
    """A step refused on its arguments (not a torch error)."""


def _attribute(x: Any, name: str) -> Any:
    if not isinstance(x, torch.Tensor) or name not in spec.ALLOWED_ATTRIBUTES:
        raise _Refused(f"attribute {name!r} of a {type(x).__name__}")
    getters: dict[str, Callable[[], Any]] = {
        "shape": lambda: x.shape,
        "ndim": lambda: x.ndim,
        "dtype": lambda: x.dtype,
        "T": lambda: x.T,
        "mT": lambda: x.mT,
    }
    return getters[name]()


def _to(x: torch.Tensor, target: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`.to` for dtypes only (a tensor argument gives its dtype): never another device."""
    if args or kwargs or not isinstance(target, (torch.dtype, torch.Tensor)):
        raise _Refused(".to() takes only a dtype here")
    return x.to(target if isinstance(target, torch.dtype) else target.dtype)


def _python_op(fn: Fn) -> Fn:
    """An operator: on tensors as torch has it; on plain Python values (sizes) numbers only,
    results bounded, so no graph builds a huge int, string or list on the host."""

    def call(*args: Any) -> Any:
        if any(isinstance(a, torch.Tensor) for a in args):
            return fn(*args)
        if fn is operator.getitem:
            if not isinstance(args[0], (tuple, torch.Size)):
                raise _Refused("indexing a non-tensor")
            return fn(*args)
        if not all(isinstance(a, (int, float, bool)) for a in args):
            raise _Refused(f"{fn.__name__} on {[type(a).__name__ for a in args]}")
        if fn is operator.pow and isinstance(args[1], int) and abs(args[1]) > 64:
            raise _Refused("integer power above 64")
        out = fn(*args)
        if isinstance(out, int) and abs(out) >= 2**63:
            raise _Refused("integer result out of range")
        return out

    return call


def _tables() -> dict[str, Fn]:
    """Function targets -> callables, from the allowlist's own names (constants, not input)."""
    table: dict[str, Fn] = {}
    for name in spec.ALLOWED_FUNCTIONS:
        module, _, attr = name.rpartition(".")
        if module == "torch":
            table[name] = getattr(torch, attr)
        elif module == "operator":
            table[name] = _python_op(getattr(operator, attr))
    table.update(
        {
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
            "math.log": _python_op(math.log),
            "math.exp": _python_op(math.exp),
            "math.sqrt": _python_op(math.sqrt),
            "getattr": _attribute,
        }
    )
    return table


FUNCTIONS: dict[str, Fn] = _tables()
METHODS: dict[str, Fn] = {
    name: getattr(torch.Tensor, name) for name in spec.ALLOWED_METHODS if name != "to"
} | {"to": _to}
assert set(FUNCTIONS) == spec.ALLOWED_FUNCTIONS, "the torch table and the allowlist must agree"
assert set(METHODS) == spec.ALLOWED_METHODS, "the torch table and the allowlist must agree"


@dataclass(frozen=True)
class _Step:
    name: str
    target: str
    fn: Fn
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Program:
    """A rebuilt loss: steps in order, the input names, and where the outputs are."""

    loss: CustomLoss
    steps: tuple[_Step, ...]
    output: Any  # encoded (loss, metrics)

    @property
    def name(self) -> str:
        return self.loss.name


def rebuild(loss: CustomLoss) -> Program:
    steps = []
    for node in loss.nodes:
        if node.op == spec.NodeOp.CALL_FUNCTION:
            fn = FUNCTIONS[node.target]
        elif node.op == spec.NodeOp.CALL_METHOD:
            fn = METHODS[node.target]
        else:
            continue
        steps.append(_Step(node.name, node.target, fn, node.args, dict(node.kwargs)))
    return Program(loss, tuple(steps), loss.nodes[-1].args[0])


_PROGRAMS: OrderedDict[str, Program] = OrderedDict()


def program(loss: CustomLoss) -> Program:
    """The rebuilt loss, cached by id (a stored loss never changes)."""
    found = _PROGRAMS.get(loss.loss_id)
    if found is None or found.loss != loss:
        found = _PROGRAMS[loss.loss_id] = rebuild(loss)
    _PROGRAMS.move_to_end(loss.loss_id)
    while len(_PROGRAMS) > 256:
        _PROGRAMS.popitem(last=False)
    return found


def _decode(value: Any, env: dict[str, Any], device: torch.device) -> Any:
    if isinstance(value, list):
        return [_decode(v, env, device) for v in value]
    if not isinstance(value, dict):
        return value
    ((kind, inner),) = value.items()
    if kind == "ref":
        return env[inner]
    if kind == "tuple":
        return tuple(_decode(v, env, device) for v in inner)
    if kind == "dict":
        return {k: _decode(v, env, device) for k, v in inner.items()}
    if kind == "slice":
        return slice(*(_decode(v, env, device) for v in inner))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "float":
        return spec.decode_float(inner)
    if kind == "dtype":
        return _DTYPES[inner]
    if kind == "device":
        return device  # a graph never picks a device: values live on the engine's
    return _CONSTANTS[kind][inner]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def _run(
    prog: Program, inputs: dict[str, torch.Tensor], check: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run the steps; `check` (the meta dry run) enforces the size limits on each value."""
    device = inputs["logprobs"].device
    env: dict[str, Any] = dict(inputs)
    total = 0
    for step in prog.steps:
        where = f"custom loss {prog.name!r}, node {step.name!r} ({step.target})"
        args = _decode(list(step.args), env, device)
        kwargs = {k: _decode(v, env, device) for k, v in step.kwargs.items()}
        if step.target in _PLACED:
            kwargs["device"] = device
        if step.target == "operator.getitem" and any(_tensors(args[1:])):
            raise UserInputError("graph", f"{where}: indexing with tensors is not allowed")
        try:
            out = step.fn(*args, **kwargs)
        except _Refused as exc:
            raise UserInputError("graph", f"{where}: not allowed: {exc}") from None
        except NotImplementedError as exc:  # what meta tensors say of value-dependent shapes
            raise UserInputError(
                "graph", f"{where}: its shape depends on values ({str(exc)[:200]})"
            ) from None
        except Exception as exc:  # any op's own error is the graph's fault: a 400, never a 500
            raise UserInputError(
                "graph", f"{where} failed: {type(exc).__name__}: {str(exc)[:300]}"
            ) from None
        if check:
            for t in _tensors(out):
                total += t.numel()
                if t.numel() > spec.MAX_ELEMENTS or total > spec.MAX_TOTAL_ELEMENTS:
                    raise UserInputError(
                        "graph",
                        f"{where} makes a tensor of {t.numel()} elements ({total} in all); "
                        f"at most {spec.MAX_ELEMENTS} ({spec.MAX_TOTAL_ELEMENTS} in all)",
                    )
        env[step.name] = out
    loss, metrics = _decode(prog.output, env, device)
    _check_scalar(prog, "the loss", loss)
    for key, value in metrics.items():
        _check_scalar(prog, f"metric {key!r}", value)
    return loss, metrics


def _check_scalar(prog: Program, what: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor) or value.ndim != 0:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise UserInputError(
            "graph", f"custom loss {prog.name!r}: {what} must be a scalar tensor, got {shape}"
        )
    if not value.is_floating_point():
        raise UserInputError("graph", f"custom loss {prog.name!r}: {what} must be a float tensor")


Shapes = tuple[tuple[tuple[int, ...], str], ...]
_CHECKED: OrderedDict[tuple[str, Shapes], None] = OrderedDict()


def dry_run(prog: Program, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Run on meta tensors of these shapes: refuses what breaks a limit, computes nothing.

    Raises:
        UserInputError: naming the loss and the node.
    """
    key = (prog.loss.loss_id, tuple((s, str(d)) for s, d in shapes.values()))
    if key in _CHECKED:  # a loss id names one graph for good
        return
    meta = {
        name: torch.empty(shape, dtype=dtype, device="meta")
        for name, (shape, dtype) in shapes.items()
    }
    with torch.no_grad():
        _run(prog, meta, check=True)
    _CHECKED[key] = None
    while len(_CHECKED) > 4096:
        _CHECKED.popitem(last=False)


def probe_shapes(loss: CustomLoss) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    dims = {0: (), 1: (PROBE_T,), 2: (PROBE_T, PROBE_K)}
    return {x.name: (dims[x.rank], torch.float32) for x in loss.inputs}


def check_created(loss: CustomLoss) -> None:
    """The creation check beyond structure: the graph runs on probe shapes within the limits
    and returns scalars (`PROBE_T` positions, `PROBE_K` targets each)."""
    dry_run(program(loss), probe_shapes(loss))


def datum_inputs(loss: CustomLoss, datum: Datum, device: torch.device) -> dict[str, torch.Tensor]:
    """The loss_fn_inputs a loss reads as tensors (float32 or int64, as the wire sent them);
    a rank-0 input is a scalar."""
    out = {}
    for x in loss.inputs[1:]:
        value = np.asarray(datum.loss_inputs[x.name])
        tensor = torch.as_tensor(value, device=device)
        out[x.name] = tensor.reshape(()) if x.rank == 0 else tensor
    return out


def check_datum(loss: CustomLoss, datum: Datum) -> None:
    """The dry run on one datum's own shapes (logprobs has target_tokens' shape)."""
    shapes = {"logprobs": (np.asarray(datum.loss_inputs["target_tokens"]).shape, torch.float32)}
    for x in loss.inputs[1:]:
        value = np.asarray(datum.loss_inputs[x.name])
        dtype = torch.float32 if value.dtype.kind == "f" else torch.int64
        shapes[x.name] = (() if x.rank == 0 else value.shape, dtype)
    dry_run(program(loss), shapes)


def check_data(loss: CustomLoss, data: list[Datum]) -> None:
    """`check_datum` on each datum; the error names the datum."""
    for i, datum in enumerate(data):
        try:
            check_datum(loss, datum)
        except UserInputError as exc:
            raise UserInputError(f"data[{i}]", str(exc)) from None


def evaluate(
    loss: CustomLoss, logp: torch.Tensor, datum: Datum
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(scalar loss, scalar metrics) of one datum from its target logprobs (shape of
    target_tokens), differentiable in `logp`.

    Raises:
        UserInputError: the graph breaks a limit, an op fails, or the loss is NaN or inf.
    """
    check_datum(loss, datum)
    inputs = {"logprobs": logp, **datum_inputs(loss, datum, logp.device)}
    value, metrics = _run(program(loss), inputs, check=False)
    if not bool(torch.isfinite(value.detach())):
        raise UserInputError(
            "loss_fn_config.loss_id",
            f"custom loss {loss.name!r} is {float(value)} on this request's data; nothing was "
            "applied",
        )
    return value, metrics
