"""load_weights: a training checkpoint's adapter (and optionally its Adam state) into a model
(PRE phase, runs alone; a barrier for its own model).

Two forms share the op: `load_state` on an existing model, in its seq_id order, and
create-via-load, a new model (its id computed by the SDK) that starts from the checkpoint.
Either way the loaded state is snapshotted, durably, before the op is recorded.
"""

from __future__ import annotations

from typing import ClassVar

from lockstep.errors import UserInputError
from lockstep.paths import TinkerPath, checkpoint_dir
from lockstep.scheduler.ops.base import (
    AuditEntry,
    Claim,
    Phase,
    RunContext,
    SingleOp,
    SubmitContext,
    check_seq,
    new_run,
)
from lockstep.scheduler.state.catalog import NotFound
from lockstep.scheduler.state.outcome import Outcome
from lockstep.scheduler.state.records import QueuedOp
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import AuditEvent, OpKind, Optimizer


class Load(SingleOp):
    oneof = "load_weights"
    kinds: ClassVar[frozenset[str]] = frozenset({OpKind.LOAD})

    def addressed(self, req: pb.SubmitRequest) -> tuple[str, int]:
        return req.load_weights.model_id, req.load_weights.seq_id  # ("", 0): create-via-load

    def audit(self, req: pb.SubmitRequest, reply: pb.SubmitReply) -> AuditEntry:
        details = {"tinker_path": req.load_weights.path, "model_id": reply.model_id}
        return AuditEntry(AuditEvent.CHECKPOINT_LOADED, details)

    async def admit(self, ctx: SubmitContext, req: pb.SubmitRequest) -> Claim:
        owner, load = req.owner, req.load_weights
        path = TinkerPath.parse(load.path)
        if path.segment != "weights":
            raise UserInputError(
                "path", "load_state needs a training checkpoint (tinker://<run>/weights/<name>)"
            )
        await ctx.catalog.readable_checkpoint(owner, path)
        if load.optimizer:  # its Adam state goes on stepping
            ctx.engines.trainer.check_optimizer(Optimizer.ADAMW, "optimizer")
        if not checkpoint_dir(ctx.data_dir, path).is_dir():
            raise NotFound(f"checkpoint {path} has no files on this server")
        if load.HasField("model_id"):  # load_state on an existing model, in its seq order
            model = await ctx.owned_model(owner, load.model_id)
            check_seq(load.seq_id)
            return Claim(load.model_id, load.seq_id, OpKind.LOAD, 0, live_session=model.session_id)
        # create-via-load: a new model whose id the SDK computes itself
        session = await ctx.catalog.live_session(owner, load.session_id)
        if load.model_seq_id < 0:
            raise UserInputError("model_seq_id", f"must be >= 0, got {load.model_seq_id}")
        source = await ctx.store.runs.get(path.model_id)
        if source is None:
            raise NotFound(f"training run {path.model_id} does not exist")
        record = new_run(
            owner,
            session.session_id,
            load.model_seq_id,
            load.base_model if load.HasField("base_model") else source.base_model,
            source.lora,
            load.user_metadata,
        )
        return Claim(record.model_id, 0, OpKind.LOAD, 0, record)

    def phase(self, current: Phase) -> Phase | None:
        return Phase.PRE if current == Phase.PRE else None

    async def run(self, ctx: RunContext, op: QueuedOp, req: pb.SubmitRequest) -> Outcome:
        load = req.load_weights
        path = TinkerPath.parse(load.path)
        directory = checkpoint_dir(ctx.data_dir, path)
        if not directory.is_dir():
            raise UserInputError("path", f"checkpoint {load.path} has no files on this server")
        await ctx.call(ctx.engine.load_state, op.model_id, directory, load.optimizer)
        ctx.resident.add(op.model_id)
        await ctx.durable_snapshot(op.model_id, op.seq_id)
        return Outcome(
            pb.JobResult(load=pb.LoadResult(model_id=op.model_id, path=load.path)),
            snapshot_seq=op.seq_id,
        )
