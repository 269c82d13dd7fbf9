"""One op kind, one home: every queued OpKind has exactly one op module (scheduler/ops/), and
each SubmitRequest oneof reaches exactly one; a new kind without a module fails here."""

from __future__ import annotations

from typing import ClassVar

import pytest

from lockstep.errors import UserInputError
from lockstep.scheduler.ops import registry
from lockstep.scheduler.ops.base import (
    Admission,
    Op,
    PassOp,
    Phase,
    SingleOp,
    StepOp,
    SubmitContext,
)
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import OpKind


def test_every_queued_kind_has_exactly_one_op_module() -> None:
    for kind in OpKind:
        homes = [type(op).__name__ for op in registry.OPS if kind in op.kinds]
        if kind in registry.NOT_QUEUED:
            assert homes == [], f"{kind} is answered at submission, yet {homes} claim it"
        else:
            assert len(homes) == 1, f"queued kind {kind} needs exactly one op module: {homes}"
            assert registry.queued_as(kind) is not None


def test_every_submit_oneof_reaches_exactly_one_op() -> None:
    oneofs = {f.name for f in pb.SubmitRequest.DESCRIPTOR.oneofs_by_name["op"].fields}
    assert sorted(op.oneof for op in registry.OPS) == sorted(oneofs)
    with pytest.raises(UserInputError, match="unknown operation None"):
        registry.arriving_as(None)


def test_a_second_home_for_a_kind_is_refused() -> None:
    class AnotherSave(Op):
        oneof = "another_save"
        kinds: ClassVar[frozenset[str]] = frozenset({OpKind.SAVE})

        async def admit(self, ctx: SubmitContext, req: pb.SubmitRequest) -> Admission:
            raise AssertionError("never admitted")

    with pytest.raises(ValueError, match="more than one home"):
        registry._index([*registry.OPS, AnotherSave()])


def test_each_kind_runs_where_its_role_says() -> None:
    """The roles the dispatcher asks for: alone, in the ONE fused pass, in the ONE batched
    step; and the planner's phases (what used to be spelled out per kind)."""
    assert {k for k in OpKind if isinstance(registry.queued_as(k), SingleOp)} == {
        OpKind.CREATE_MODEL,
        OpKind.LOAD,
        OpKind.SAVE,
    }
    assert {k for k in OpKind if registry.is_pass(k)} == {OpKind.FORWARD, OpKind.FORWARD_BACKWARD}
    assert {k for k in OpKind if isinstance(registry.queued_as(k), StepOp)} == {OpKind.OPTIM_STEP}
    assert {k for k in OpKind if registry.trains(k)} == {OpKind.FORWARD_BACKWARD}
    fb = registry.fused_pass(OpKind.FORWARD_BACKWARD)
    assert isinstance(fb, PassOp) and not fb.backward(OpKind.FORWARD)
    with pytest.raises(RuntimeError, match="unexpected op kind"):
        registry.single(OpKind.FORWARD)

    def phases(kind: str) -> list[Phase | None]:
        op = registry.queued_as(kind)
        assert op is not None
        return [op.phase(current) for current in Phase]

    pre_only = [Phase.PRE, None, None, None]
    assert phases(OpKind.CREATE_MODEL) == phases(OpKind.LOAD) == pre_only
    assert phases(OpKind.FORWARD) == [Phase.PASS, Phase.PASS, None, None]
    assert phases(OpKind.OPTIM_STEP) == [Phase.OPTIM, Phase.OPTIM, None, None]
    assert phases(OpKind.SAVE) == [Phase.PRE, Phase.POST, Phase.POST, Phase.POST]
    refused = registry.queued_as(OpKind.REJECTED)
    assert refused is not None and refused.holds_only


def test_the_gateway_and_the_scheduler_register_the_same_ops() -> None:
    """Every op the SDK submits has a gateway op (its route) and a scheduler op (its rules),
    meeting at one SubmitRequest field; `refused` is the gateway's own report."""
    from lockstep.gateway.ops import registry as gateway

    built = {op.oneof for op in gateway.ops()}
    assert built == set(registry.BY_ONEOF) - {"refused"}
    assert len({op.path for op in gateway.ops()}) == len(gateway.ops())
    assert gateway.sequenced_paths() == {
        op.path
        for op in gateway.ops()
        if op.oneof in ("forward_backward", "optim_step", "save_weights", "load_weights")
    }
