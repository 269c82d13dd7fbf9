"""optim_step: every tenant's step runs as ONE batched optimizer step per cycle, after the
fused pass (a barrier for its own model: a later pass waits for the next cycle).

A successful step stays in its model's replay log until a snapshot covers it.
"""

from __future__ import annotations

from typing import ClassVar

from lockstep.engine.types import OptimRequest
from lockstep.errors import UserInputError
from lockstep.scheduler import translate
from lockstep.scheduler.ops.base import Claim, Phase, StepOp, SubmitContext, check_seq, finite
from lockstep.scheduler.state.outcome import Outcome
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import OpKind, Optimizer


class OptimStep(StepOp):
    oneof = "optim_step"
    kinds: ClassVar[frozenset[str]] = frozenset({OpKind.OPTIM_STEP})

    def addressed(self, req: pb.SubmitRequest) -> tuple[str, int]:
        return req.optim_step.model_id, req.optim_step.seq_id

    async def admit(self, ctx: SubmitContext, req: pb.SubmitRequest) -> Claim:
        o = req.optim_step
        model = await ctx.owned_model(req.owner, o.model_id)
        check_seq(o.seq_id)
        if not o.HasField("adam"):
            raise UserInputError("adam_params", "field required")
        ctx.engines.trainer.check_optimizer(Optimizer.ADAMW, "adam_params")
        a = o.adam
        finite(a.learning_rate, "adam_params.learning_rate", 0.0)
        finite(a.weight_decay, "adam_params.weight_decay", 0.0)
        finite(a.grad_clip_norm, "adam_params.grad_clip_norm")
        finite(a.eps, "adam_params.eps", 0.0)
        for name, beta in (("beta1", a.beta1), ("beta2", a.beta2)):
            finite(beta, f"adam_params.{name}", 0.0)
            if beta >= 1.0:
                raise UserInputError(f"adam_params.{name}", f"must be < 1, got {beta}")
        return Claim(o.model_id, o.seq_id, OpKind.OPTIM_STEP, 0, live_session=model.session_id)

    def phase(self, current: Phase) -> Phase | None:
        return Phase.OPTIM if current <= Phase.PASS else None

    def request(self, model_id: str, req: pb.SubmitRequest) -> OptimRequest:
        return OptimRequest(model_id, translate.adam_config(req.optim_step.adam))

    def outcome(self, metrics: dict[str, float], snapshot_seq: int | None) -> Outcome:
        result = pb.OptimStepResult(metrics=metrics)
        return Outcome(
            pb.JobResult(optim_step=result),
            snapshot_seq=snapshot_seq,
            replayed=True,
            metrics=dict(metrics),
        )
