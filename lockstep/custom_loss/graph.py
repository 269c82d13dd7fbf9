"""Custom losses as data: the allowlist, the structural check at creation, the per-datum check.

A custom loss arrives as the SDK's torch.fx graph encoded as plain data (`CustomLossGraph`):
nodes naming functions and methods, arguments as JSON. It is untrusted input that names things
to call, so nothing here resolves a name: a node is accepted only if its target is in the tables
below, and the torch program (`program.py`) maps the same names to callables from a fixed table
of its own. Pure Python (no torch) so every process can check it.

The tables are derived from what the SDK's tracer lets through (torch, math, operator, and
torch.Tensor methods) narrowed to tensor math: elementwise math, reductions, comparisons,
where/clamp, indexing and slicing, shape ops, log_softmax and friends. Left out on purpose:
anything that leaves torch (`item`, `tolist`, `numpy`), I/O (`torch.load`, `torch.save`),
uninitialised memory (`empty`: it could show another tenant's freed data), in-place methods and
keywords that write in place (`out=`, `inplace=`), randomness, devices, and ops whose output
shape depends on values (`nonzero`, `masked_select`). What a graph costs (FLOPs, memory) is
`pricing.py`'s to judge, on the shapes it runs on.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from enum import StrEnum

import numpy as np

from lockstep.engine.types import CustomLoss, CustomLossInput, CustomLossNode, Datum, Encoded
from lockstep.errors import UserInputError

MAX_NODES = 512  # a deep graph is refused by size: nodes run in order, none refers ahead
MAX_INPUTS = 16  # the SDK's own limit, logprobs included
MAX_METRICS = 32
MAX_ARG_VALUES = 256  # encoded values in one node's arguments
MAX_ARG_DEPTH = 8
MAX_STRING = 128
GRAPH_FORMAT = 1
# Keywords that make an op write into a tensor it was given (a datum's input, another node's
# value) instead of a new one: refused by name wherever they appear.
WRITING_KEYWORDS = frozenset({"out", "inplace"})

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_LOSS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.<>-]{0,127}")
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")


class NodeOp(StrEnum):
    """torch.fx node kinds. Only the first four are accepted."""

    PLACEHOLDER = "placeholder"
    CALL_FUNCTION = "call_function"
    CALL_METHOD = "call_method"
    OUTPUT = "output"
    GET_ATTR = "get_attr"  # a captured tensor: refused
    CALL_MODULE = "call_module"  # an nn.Module: refused


class Encoding(StrEnum):
    """The one-key objects an argument value is encoded as (`{"ref": "x"}`: node x's value),
    checked here (`_ENCODINGS`) and decoded by the program (`program._decode`)."""

    REF = "ref"
    TUPLE = "tuple"
    DICT = "dict"
    SLICE = "slice"
    ELLIPSIS = "ellipsis"
    FLOAT = "float"  # inf, -inf, nan (JSON has no spelling for them)
    DTYPE = "dtype"  # a name in DTYPES
    DEVICE = "device"  # ignored: values live on the engine's device
    LAYOUT = "layout"  # a name in CONSTANTS["layout"]
    MEMORY_FORMAT = "memory_format"  # a name in CONSTANTS["memory_format"]


_KINDS = frozenset(Encoding)


class Reduction(StrEnum):
    """How a metric combines across datums (its key's suffix)."""

    SUM = "sum"
    MEAN = "mean"


ELEMENTWISE = (
    "abs exp exp2 expm1 log log1p log2 log10 sqrt rsqrt square sign sigmoid tanh relu erf "
    "sin cos reciprocal floor ceil round trunc isfinite isnan isinf nan_to_num logical_not "
    "logical_and logical_or logical_xor minimum maximum fmin fmax where clamp clip clamp_min "
    "clamp_max pow lerp mul add sub div true_divide eq ne lt le gt ge neg"
).split()
_REDUCTIONS = (
    "sum mean prod amax amin max min any all logsumexp std var cumsum count_nonzero".split()
)
_SHAPES = "reshape flatten squeeze unsqueeze transpose permute t flip roll diff".split()
# No gather or tensor indices: an out-of-range index there is a device-side assert on a GPU,
# which takes the whole engine down with it. Integer indices are checked on the host against
# the indexed tensor's shape before the op runs (`program.check_index`).
_OTHER = "log_softmax softmax dot matmul outer masked_fill argmax argmin".split()

# Python operators fx records (on tensors and on sizes), by their public module's names.
OPERATORS = (
    "add sub mul truediv floordiv mod pow neg pos abs eq ne lt le gt ge and_ or_ xor invert "
    "getitem matmul"
).split()

# call_function targets, as the SDK names them (operator functions by their public module).
ALLOWED_FUNCTIONS: frozenset[str] = frozenset(
    [f"torch.{n}" for n in ELEMENTWISE + _REDUCTIONS + _SHAPES + _OTHER]
    + [
        f"torch.{n}"
        for n in "stack cat einsum zeros_like ones_like full_like zeros ones full arange".split()
    ]
    + [f"operator.{n}" for n in OPERATORS]
    + [
        "torch._C._nn.log_sigmoid",
        "torch._C._nn.softplus",
        "torch.nn.functional.logsigmoid",
        "torch.nn.functional.log_softmax",
        "torch.nn.functional.softmax",
        "torch.nn.functional.relu",
        "torch.nn.functional.softplus",
        "torch.nn.functional.mse_loss",
        "torch.nn.functional.binary_cross_entropy_with_logits",
        "torch.functional.einsum",  # what the SDK's tracer calls torch.einsum
        "math.log",
        "math.exp",
        "math.sqrt",
        "getattr",  # builtins.getattr: only the attributes in ALLOWED_ATTRIBUTES
    ]
)
# call_method targets: torch.Tensor methods (never in-place ones, never host ones).
ALLOWED_METHODS: frozenset[str] = frozenset(
    ELEMENTWISE
    + _REDUCTIONS
    + _SHAPES
    + _OTHER
    + (
        "float double long int bool to type_as detach clone contiguous view view_as expand "
        "expand_as repeat size dim numel new_zeros new_ones new_full"
    ).split()
)
ALLOWED_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "T", "mT"})
# torch's names of the dtypes and constants an argument may name (the program maps each to
# torch's object of that name).
DTYPES = frozenset(
    {"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "bool"}
)
CONSTANTS = {
    Encoding.LAYOUT: frozenset({"strided"}),
    Encoding.MEMORY_FORMAT: frozenset({"contiguous_format", "preserve_format"}),
}
_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _refuse(index: int, node: str, message: str) -> UserInputError:
    return UserInputError(f"graph.nodes[{index}]", f"node {node!r}: {message}")


def check_inputs(inputs: list[tuple[str, int]]) -> tuple[CustomLossInput, ...]:
    """The declared inputs: `logprobs` first (rank 1 or 2), then loss_fn_inputs keys."""
    if not inputs or inputs[0][0] != "logprobs":
        raise UserInputError("inputs", "the first input must be 'logprobs'")
    if len(inputs) > MAX_INPUTS:
        raise UserInputError("inputs", f"{len(inputs)} inputs; at most {MAX_INPUTS}")
    if inputs[0][1] not in (1, 2):
        raise UserInputError("inputs[0].rank", "logprobs has rank 1 ([T]) or 2 ([T, K])")
    seen: set[str] = set()
    for i, (name, rank) in enumerate(inputs):
        if not _INPUT_NAME.fullmatch(name) or name in seen:
            raise UserInputError(f"inputs[{i}].name", f"{name!r} is not a new lowercase name")
        if name == "target_tokens":
            raise UserInputError(f"inputs[{i}].name", "target_tokens is not a loss input")
        if rank not in (0, 1, 2):
            raise UserInputError(f"inputs[{i}].rank", f"must be 0, 1 or 2, got {rank!r}")
        seen.add(name)
    return tuple(CustomLossInput(name, rank) for name, rank in inputs)


def build_loss(
    loss_id: str, name: str, inputs: list[tuple[str, int]], nodes: list[CustomLossNode]
) -> CustomLoss:
    """Check a graph against the allowlist and the limits; the `CustomLoss` to store.

    Raises:
        UserInputError: naming the first node (`graph.nodes[i]`) or field that is refused.
    """
    if not _LOSS_NAME.fullmatch(name):
        raise UserInputError("name", f"{name[:64]!r} is not a valid loss name")
    declared = check_inputs(inputs)
    if not nodes:
        raise UserInputError("graph.nodes", "is empty")
    if len(nodes) > MAX_NODES:
        raise UserInputError(
            "graph.nodes", f"{len(nodes)} nodes; a custom loss has at most {MAX_NODES}"
        )
    defined: set[str] = set()
    placeholders: list[str] = []
    for i, node in enumerate(nodes):
        if not _NAME.fullmatch(node.name) or node.name in defined:
            raise _refuse(i, node.name[:64], "its name is not a new identifier")
        _check_node(i, node, defined, nodes, len(placeholders))
        if node.op == NodeOp.PLACEHOLDER:
            placeholders.append(node.target)
        defined.add(node.name)
    if placeholders != [x.name for x in declared]:
        raise UserInputError(
            "graph.nodes",
            f"the graph's inputs {placeholders} are not the declared inputs "
            f"{[x.name for x in declared]}",
        )
    if nodes[-1].op != NodeOp.OUTPUT:
        raise UserInputError("graph.nodes", "the last node must be the output")
    return CustomLoss(loss_id, name, declared, tuple(nodes))


def _check_node(
    i: int, node: CustomLossNode, defined: set[str], nodes: list[CustomLossNode], n_inputs: int
) -> None:
    try:
        op = NodeOp(node.op)
    except ValueError:
        raise _refuse(i, node.name, f"unknown node op {node.op[:32]!r}") from None
    if op is NodeOp.GET_ATTR:
        raise _refuse(i, node.name, "reads a captured tensor (get_attr); not allowed")
    if op is NodeOp.CALL_MODULE:
        raise _refuse(i, node.name, "calls a module (call_module); not allowed")
    if op is NodeOp.PLACEHOLDER:
        if i != n_inputs or node.args or node.kwargs:
            raise _refuse(i, node.name, "inputs come first and take no arguments")
        return
    _check_args(i, node, defined)
    if op is NodeOp.OUTPUT:
        if i != len(nodes) - 1:
            raise _refuse(i, node.name, "the output must be the last node")
        _check_output(i, node)
        return
    _check_call(i, node, op)


def _check_call(i: int, node: CustomLossNode, op: NodeOp) -> None:
    target = node.target
    allowed = ALLOWED_FUNCTIONS if op is NodeOp.CALL_FUNCTION else ALLOWED_METHODS
    if target not in allowed:
        kind = "function" if op is NodeOp.CALL_FUNCTION else "method"
        raise _refuse(
            i, node.name, f"calls {kind} {target[:80]!r}, which is not an allowed operation"
        )
    if op is NodeOp.CALL_METHOD and not (node.args and _is_ref(node.args[0])):
        raise _refuse(i, node.name, f"method {target!r} must be called on a node")
    if target == "getattr":
        if len(node.args) != 2 or not _is_ref(node.args[0]) or node.kwargs:
            raise _refuse(i, node.name, "getattr takes a node and an attribute name")
        if node.args[1] not in ALLOWED_ATTRIBUTES:
            raise _refuse(
                i,
                node.name,
                f"reads attribute {str(node.args[1])[:40]!r}; allowed: "
                f"{', '.join(sorted(ALLOWED_ATTRIBUTES))}",
            )


def encoded(value: Encoded) -> tuple[Encoding, Encoded] | None:
    """What a one-key object encodes and its payload (None: a plain value or list, or not an
    encoding this format has)."""
    if not isinstance(value, dict) or len(value) != 1:
        return None
    ((kind, inner),) = value.items()
    return (Encoding(kind), inner) if kind in _KINDS else None


def _is_ref(value: Encoded) -> bool:
    found = encoded(value)
    return found is not None and found[0] is Encoding.REF


def _check_output(i: int, node: CustomLossNode) -> None:
    out = node.args[0] if len(node.args) == 1 and not node.kwargs else None
    found = encoded(out)
    pair = found[1] if found is not None and found[0] is Encoding.TUPLE else out
    if not isinstance(pair, list) or len(pair) != 2 or not _is_ref(pair[0]):
        raise _refuse(i, node.name, "must return (loss, metrics) with the loss a tensor")
    found = encoded(pair[1])
    metrics = found[1] if found is not None and found[0] is Encoding.DICT else None
    if not isinstance(metrics, dict):
        raise _refuse(i, node.name, "must return its metrics as a dict")
    if len(metrics) > MAX_METRICS:
        raise _refuse(i, node.name, f"{len(metrics)} metrics; at most {MAX_METRICS}")
    for key, value in metrics.items():
        if not METRIC_KEY.fullmatch(key):
            raise _refuse(
                i, node.name, f"metric {key[:80]!r} must be named custom/<name>:sum or :mean"
            )
        if not _is_ref(value):
            raise _refuse(i, node.name, f"metric {key!r} must be a tensor")


def _check_args(i: int, node: CustomLossNode, defined: set[str]) -> None:
    count = 0
    for value, depth in _walk([*node.args, *node.kwargs.values()], 1):
        count += 1
        if count > MAX_ARG_VALUES or depth > MAX_ARG_DEPTH:
            raise _refuse(i, node.name, "its arguments are too large or too deeply nested")
        problem = _value_problem(value, defined)
        if problem:
            raise _refuse(i, node.name, problem)
    for key in node.kwargs:
        if not _NAME.fullmatch(key):
            raise _refuse(i, node.name, f"keyword {key[:40]!r} is not an identifier")
        if key in WRITING_KEYWORDS:
            raise _refuse(
                i,
                node.name,
                f"keyword {key!r} writes into an existing tensor; a custom loss may not write "
                "in place (return new values instead)",
            )


def _walk(values: list[Encoded], depth: int) -> Iterator[tuple[Encoded, int]]:
    for value in values:
        yield value, depth
        found = encoded(value)
        if isinstance(value, list):
            yield from _walk(value, depth + 1)
        elif found is not None:
            kind, inner = found
            if kind in (Encoding.TUPLE, Encoding.SLICE) and isinstance(inner, list):
                yield from _walk(inner, depth + 1)
            elif kind is Encoding.DICT and isinstance(inner, dict):
                yield from _walk(list(inner.values()), depth + 1)


def _value_problem(value: Encoded, defined: set[str]) -> str | None:
    """Why an encoded argument value is refused (None: it is fine). Containers' items are
    walked separately."""
    if value is None or isinstance(value, (bool, list)):
        return None
    if isinstance(value, int):
        return None if abs(value) < 2**62 else f"integer {value} is out of range"
    if isinstance(value, float):
        return None if math.isfinite(value) else "non-finite floats are encoded as {'float': ...}"
    if isinstance(value, str):
        return None if len(value) <= MAX_STRING else "a string argument is too long"
    if not isinstance(value, dict) or len(value) != 1:
        return f"unknown argument encoding {str(value)[:60]!r}"
    found = encoded(value)
    if found is None:
        return f"unknown argument encoding {next(iter(value))[:40]!r}"
    kind, inner = found
    if kind is Encoding.REF:
        return None if inner in defined else f"refers to {str(inner)[:40]!r}, not an earlier node"
    return None if _ENCODINGS[kind](inner) else f"bad {kind} {str(inner)[:40]!r}"


def _slice_ok(inner: Encoded) -> bool:
    return (
        isinstance(inner, list)
        and len(inner) == 3
        and all(v is None or type(v) is int or _is_ref(v) for v in inner)
    )


# Each encoding -> whether its payload is acceptable.
_ENCODINGS: dict[Encoding, Callable[[Encoded], bool]] = {
    Encoding.REF: lambda inner: isinstance(inner, str),
    Encoding.TUPLE: lambda inner: isinstance(inner, list),
    # Keys are data (metric names, which `_check_output` checks by name).
    Encoding.DICT: lambda inner: (
        isinstance(inner, dict) and all(len(k) <= MAX_STRING for k in inner)
    ),
    Encoding.SLICE: _slice_ok,
    Encoding.ELLIPSIS: lambda inner: inner is True,
    Encoding.FLOAT: lambda inner: isinstance(inner, str) and inner in _FLOATS,
    Encoding.DTYPE: lambda inner: isinstance(inner, str) and inner in DTYPES,
    Encoding.DEVICE: lambda inner: isinstance(inner, str),
    Encoding.LAYOUT: lambda inner: isinstance(inner, str) and inner in CONSTANTS[Encoding.LAYOUT],
    Encoding.MEMORY_FORMAT: lambda inner: (
        isinstance(inner, str) and inner in CONSTANTS[Encoding.MEMORY_FORMAT]
    ),
}
assert set(_ENCODINGS) == set(Encoding), "every encoding is checked"


def decode_float(value: Encoded) -> float:
    assert isinstance(value, str)  # checked at creation (`Encoding.FLOAT`)
    return _FLOATS[value]


# The shapes a datum gives a loss's inputs, in the loss's input order: (shape, dtype name).
Shapes = tuple[tuple[tuple[int, ...], str], ...]


def datum_shapes(loss: CustomLoss, datum: Datum) -> Shapes:
    """The shapes a datum gives the loss's inputs (logprobs: those of target_tokens)."""
    out: list[tuple[tuple[int, ...], str]] = [
        (tuple(np.shape(datum.loss_inputs["target_tokens"])), "float32")
    ]
    for x in loss.inputs[1:]:
        value = np.asarray(datum.loss_inputs[x.name])
        dtype = "float32" if value.dtype.kind == "f" else "int64"
        out.append((() if x.rank == 0 else tuple(value.shape), dtype))
    return tuple(out)


def check_datum(loss: CustomLoss, datum: Datum, index: int) -> None:
    """A datum's inputs against the loss's declared ranks: `logprobs` has target_tokens' rank,
    every other input is present, at its rank, real and finite. A rank-0 input is one value
    (the wire sends a scalar with no shape, as one element)."""
    logprobs, *rest = loss.inputs
    rank = np.ndim(datum.loss_inputs["target_tokens"])
    if rank != logprobs.rank:
        raise UserInputError(
            f"data[{index}].loss_fn_inputs.target_tokens",
            f"has rank {rank}, but loss {loss.name!r} declared logprobs with rank {logprobs.rank}",
        )
    for x in rest:
        found = datum.loss_inputs.get(x.name)
        if found is None:
            raise UserInputError(
                f"data[{index}].loss_fn_inputs.{x.name}", f"required by custom loss {loss.name!r}"
            )
        value = np.asarray(found)
        rank = 0 if x.rank == 0 and value.size == 1 and value.ndim <= 1 else value.ndim
        if rank != x.rank:
            raise UserInputError(
                f"data[{index}].loss_fn_inputs.{x.name}",
                f"has rank {value.ndim} (shape {value.shape}), but loss {loss.name!r} declared "
                f"it with rank {x.rank}",
            )
        kind = value.dtype.kind  # integers are finite; floats must be
        if kind not in "fiu" or (kind == "f" and not np.isfinite(value).all()):
            raise UserInputError(
                f"data[{index}].loss_fn_inputs.{x.name}", "must be finite real numbers"
            )
