"""create_model: a new training run with a fresh LoRA adapter (PRE phase, runs alone).

Its model record is claimed with the op (the tenant quotas are checked atomically with it);
after the engine creates the adapter its state is snapshotted, durably, before the op is
recorded: nothing earlier exists to replay from.
"""

from __future__ import annotations

from typing import ClassVar

from lockstep.engine.types import LoraSpec
from lockstep.errors import UserInputError
from lockstep.scheduler.ops.base import (
    AuditEntry,
    Claim,
    Phase,
    RunContext,
    SingleOp,
    SubmitContext,
    new_run,
)
from lockstep.scheduler.state.outcome import Outcome
from lockstep.scheduler.state.records import LoraRecord, QueuedOp
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import AuditEvent, OpKind, Optimizer


def lora_spec(cfg: pb.LoraConfig) -> LoraSpec:
    return LoraSpec(
        rank=cfg.rank,
        alpha=32.0,
        seed=cfg.seed if cfg.HasField("seed") else None,
        train_attn=cfg.train_attn,
        train_mlp=cfg.train_mlp,
        train_unembed=cfg.train_unembed,
    )


class CreateModel(SingleOp):
    oneof = "create_model"
    kinds: ClassVar[frozenset[str]] = frozenset({OpKind.CREATE_MODEL})

    async def admit(self, ctx: SubmitContext, req: pb.SubmitRequest) -> Claim:
        owner, c = req.owner, req.create_model
        session = await ctx.catalog.live_session(owner, c.session_id)
        if c.model_seq_id < 0:
            raise UserInputError("model_seq_id", f"must be >= 0, got {c.model_seq_id}")
        ctx.catalog.resolve_base_model(c.base_model)
        lc = c.lora_config
        if not 1 <= lc.rank <= ctx.limits.max_lora_rank:
            raise UserInputError("lora_config.rank", f"must be in [1, {ctx.limits.max_lora_rank}]")
        if not (lc.train_attn or lc.train_mlp or lc.train_unembed):
            raise UserInputError(
                "lora_config", "at least one of train_mlp, train_attn, train_unembed must be true"
            )
        optimizer = Optimizer.ADAMW  # the SDK's default
        if c.optimizer_type:
            optimizer = Optimizer.named("optimizer_config.type", c.optimizer_type)
        ctx.engines.trainer.check_optimizer(optimizer, "optimizer_config.type")
        record = new_run(
            owner,
            session.session_id,
            c.model_seq_id,
            c.base_model,
            LoraRecord(
                rank=lc.rank,
                seed=lc.seed if lc.HasField("seed") else None,
                train_attn=lc.train_attn,
                train_mlp=lc.train_mlp,
                train_unembed=lc.train_unembed,
            ),
            c.user_metadata,
        )
        return Claim(record.model_id, 0, OpKind.CREATE_MODEL, 0, record)

    def audit(self, req: pb.SubmitRequest, reply: pb.SubmitReply) -> AuditEntry:
        return AuditEntry(AuditEvent.TRAINING_RUN_CREATED, {"model_id": reply.model_id})

    def phase(self, current: Phase) -> Phase | None:
        return Phase.PRE if current == Phase.PRE else None

    async def run(self, ctx: RunContext, op: QueuedOp, req: pb.SubmitRequest) -> Outcome:
        spec = lora_spec(req.create_model.lora_config)
        await ctx.call(ctx.engine.create_model, op.model_id, spec)
        ctx.resident.add(op.model_id)
        await ctx.durable_snapshot(op.model_id, op.seq_id)
        result = pb.CreateModelResult(model_id=op.model_id)
        return Outcome(pb.JobResult(create_model=result), snapshot_seq=op.seq_id)
