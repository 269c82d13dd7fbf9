"""The op registry: every op kind's module, looked up by the SubmitRequest oneof it arrives in
or by the kind it is queued as (`OpKind` for the built-in ones; an op may bring its own). Adding
an op is adding its module to `OPS` (and its proto message and its gateway op,
`lockstep/gateway/ops/`: docs/ARCHITECTURE.md, "Adding an op"); tests/unit/test_op_registry.py
fails for a queued kind without one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from lockstep.errors import UserInputError
from lockstep.scheduler.ops.base import Op, PassOp, SingleOp, StepOp
from lockstep.scheduler.ops.create import CreateModel
from lockstep.scheduler.ops.forward_backward import ForwardBackward
from lockstep.scheduler.ops.load import Load
from lockstep.scheduler.ops.optim_step import OptimStep
from lockstep.scheduler.ops.refused import Refused
from lockstep.scheduler.ops.sample import Sample
from lockstep.scheduler.ops.save import Save
from lockstep.vocab import OpKind

OPS: tuple[Op, ...] = (
    CreateModel(),
    Load(),
    ForwardBackward(),
    OptimStep(),
    Save(),
    Sample(),
    Refused(),
)

# Kinds answered at submission by their own services, never queued: no op module.
NOT_QUEUED = frozenset({OpKind.UNLOAD_MODEL, OpKind.CREATE_CUSTOM_LOSS})


def _index(ops: Iterable[Op]) -> tuple[dict[str, Op], dict[str, Op]]:
    by_oneof: dict[str, Op] = {}
    by_kind: dict[str, Op] = {}
    for op in ops:
        if op.oneof in by_oneof:
            raise ValueError(f"two op modules arrive as {op.oneof!r}")
        by_oneof[op.oneof] = op
        for kind in op.kinds:
            if kind in by_kind or kind in NOT_QUEUED:
                raise ValueError(f"op kind {kind} has more than one home")
            by_kind[kind] = op
    return by_oneof, by_kind


BY_ONEOF, BY_KIND = _index(OPS)


@contextmanager
def registered(*ops: Op) -> Iterator[None]:
    """Run `ops` while the block runs (what a line in `OPS` does), each in place of the op that
    arrives as its oneof, if any (tests/integration/test_adding_an_op.py)."""
    global BY_ONEOF, BY_KIND
    before = BY_ONEOF, BY_KIND
    replaced = {op.oneof for op in ops}
    BY_ONEOF, BY_KIND = _index([*(op for op in OPS if op.oneof not in replaced), *ops])
    try:
        yield
    finally:
        BY_ONEOF, BY_KIND = before


def arriving_as(oneof: str | None) -> Op:
    """The op of a SubmitRequest's `op` field; an unknown one is a 400."""
    op = BY_ONEOF.get(oneof or "")
    if op is None:
        raise UserInputError("type", f"unknown operation {oneof!r}")
    return op


def queued_as(kind: str) -> Op | None:
    """The op of a queued job's kind (None: a kind no cycle runs)."""
    return BY_KIND.get(kind)


def _unexpected(kind: str) -> RuntimeError:
    return RuntimeError(f"unexpected op kind {kind}")


def single(kind: str) -> SingleOp:
    """The op of a kind that runs alone (create, load, save)."""
    op = BY_KIND.get(kind)
    if not isinstance(op, SingleOp):
        raise _unexpected(kind)
    return op


def fused_pass(kind: str) -> PassOp:
    """The op of a kind that joins the fused pass."""
    op = BY_KIND.get(kind)
    if not isinstance(op, PassOp):
        raise _unexpected(kind)
    return op


def step(kind: str) -> StepOp:
    """The op of a kind that joins the batched optimizer step."""
    op = BY_KIND.get(kind)
    if not isinstance(op, StepOp):
        raise _unexpected(kind)
    return op


def is_pass(kind: str) -> bool:
    return isinstance(BY_KIND.get(kind), PassOp)


def trains(kind: str) -> bool:
    """Whether an op of `kind` trains its pass tokens (a pass that runs backward)."""
    op = BY_KIND.get(kind)
    return isinstance(op, PassOp) and op.backward(kind)
