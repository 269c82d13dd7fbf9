"""What a contributor writes as lockstep/scheduler/ops/sgd_step.py (and a line in
lockstep/scheduler/ops/registry.py's OPS: the test registers it for its block)."""

from __future__ import annotations

import math
from typing import ClassVar

from lockstep.engine.interface import Verb
from lockstep.errors import UserInputError
from lockstep.scheduler.ops.base import Claim, Phase, RunContext, SingleOp, SubmitContext, check_seq
from lockstep.scheduler.state.outcome import Outcome
from lockstep.scheduler.state.records import QueuedOp
from lockstep.v1 import scheduler_pb2 as pb

# Its engine verb: (model_id, learning_rate) -> the gradient's norm before the step.
SGD_STEP: Verb[[str, float], float] = Verb("sgd_step")


class SgdStep(SingleOp):
    oneof = "sgd_step"  # the SubmitRequest field it arrives in
    kinds: ClassVar[frozenset[str]] = frozenset({"sgd_step"})  # queued under a kind of its own
    verbs = (SGD_STEP.name,)  # refused where the training engine does not serve it

    def addressed(self, req: pb.SubmitRequest) -> tuple[str, int]:  # a refusal holds its seq_id
        return req.sgd_step.model_id, req.sgd_step.seq_id

    async def admit(self, ctx: SubmitContext, req: pb.SubmitRequest) -> Claim:
        step = req.sgd_step  # the one place its rules live: the 400s
        model = await ctx.owned_model(req.owner, step.model_id)
        check_seq(step.seq_id)
        lr = step.learning_rate
        if not (math.isfinite(lr) and 0 < lr <= 1):
            raise UserInputError("learning_rate", f"a SGD step takes (0, 1], got {lr}")
        return Claim(step.model_id, step.seq_id, "sgd_step", 0, live_session=model.session_id)

    def phase(self, current: Phase) -> Phase | None:  # alone, after the cycle's pass and step
        return Phase.POST

    async def run(self, ctx: RunContext, op: QueuedOp, req: pb.SubmitRequest) -> Outcome:
        step = SGD_STEP.on(ctx.engine)
        grad_norm = await ctx.call(step, op.model_id, req.sgd_step.learning_rate)
        await ctx.durable_snapshot(op.model_id, op.seq_id)  # so nothing before it replays
        result = pb.JobResult(sgd_step=pb.SgdStepResult(grad_norm=grad_norm))
        return Outcome(result, snapshot_seq=op.seq_id)
