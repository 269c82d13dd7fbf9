"""save_weights: a named checkpoint (training state, sampler or external weights), or the
ephemeral sampler weights of a new sampling session (runs alone: PRE before any pass of its
model in the cycle, else POST, after the pass and the step).

The checkpoint is written to a temporary directory and renamed in (encrypted first when
`age_recipients` are given); its record is registered by the op's commit.
"""

from __future__ import annotations

import asyncio
import time
from typing import ClassVar

from lockstep.errors import UserInputError
from lockstep.paths import TinkerPath, checkpoint_dir, ephemeral_dir, validate_name
from lockstep.scheduler.ops.base import (
    Claim,
    Phase,
    RunContext,
    SingleOp,
    SubmitContext,
    check_seq,
)
from lockstep.scheduler.state import encryption, storage
from lockstep.scheduler.state.outcome import Outcome
from lockstep.scheduler.state.records import (
    CheckpointRecord,
    InflightTarget,
    ModelRecord,
    QueuedOp,
    SamplerRecord,
)
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import OpKind

_SEGMENTS = {
    pb.CHECKPOINT_KIND_TRAINING: "weights",
    pb.CHECKPOINT_KIND_SAMPLER: "sampler_weights",
    pb.CHECKPOINT_KIND_EXTERNAL: "external_weights",
}


class Save(SingleOp):
    oneof = "save_weights"
    kinds: ClassVar[frozenset[str]] = frozenset({OpKind.SAVE})

    def addressed(self, req: pb.SubmitRequest) -> tuple[str, int]:
        return req.save_weights.model_id, req.save_weights.seq_id

    def identity(self, req: pb.SubmitRequest) -> bytes | None:
        """The SDK retries an ephemeral save_weights_for_sampler
        (save_weights_and_get_sampling_client) under the same seq_id but with the next
        sampling_session_seq_id from its counter; it is the same request, and the first one's
        sampler is the one the SDK is told about."""
        if not req.save_weights.HasField("sampling_session_seq_id"):
            return None
        same = pb.SubmitRequest()
        same.CopyFrom(req)
        same.save_weights.ClearField("sampling_session_seq_id")
        return bytes(same.SerializeToString(deterministic=True))

    async def admit(self, ctx: SubmitContext, req: pb.SubmitRequest) -> Claim:
        s = req.save_weights
        model = await ctx.owned_model(req.owner, s.model_id)
        check_seq(s.seq_id)
        if s.HasField("name"):
            validate_name(s.name, "path")
        elif s.kind != pb.CHECKPOINT_KIND_SAMPLER:
            raise UserInputError("path", "field required")
        elif not s.HasField("sampling_session_seq_id"):
            raise UserInputError("path", "give a name (path) or a sampling_session_seq_id")
        elif s.sampling_session_seq_id < 0:
            raise UserInputError("sampling_session_seq_id", "must be >= 0")
        if s.HasField("ttl_seconds") and s.ttl_seconds <= 0:
            raise UserInputError("ttl_seconds", "must be positive")
        if s.age_recipients:
            if s.kind != pb.CHECKPOINT_KIND_EXTERNAL:
                raise UserInputError(encryption.FIELD, "only save_weights_external encrypts")
            encryption.parse_recipients(list(s.age_recipients))
        return Claim(s.model_id, s.seq_id, OpKind.SAVE, 0, live_session=model.session_id)

    def phase(self, current: Phase) -> Phase | None:
        return Phase.PRE if current == Phase.PRE else Phase.POST

    async def run(self, ctx: RunContext, op: QueuedOp, req: pb.SubmitRequest) -> Outcome:
        model = await ctx.store.runs.get(op.model_id)
        if model is None:
            raise RuntimeError(f"model {op.model_id} has no record")
        await ctx.ensure_resident(op.model_id)  # after a failed snapshot earlier this cycle
        if not req.save_weights.HasField("name"):
            return await _sampler_weights(ctx, op, req.owner, req.save_weights, model)
        return await _checkpoint(ctx, op, req.save_weights)


async def _sampler_weights(
    ctx: RunContext, op: QueuedOp, owner: str, save: pb.SaveWeights, model: ModelRecord
) -> Outcome:
    """Ephemeral sampler weights -> a new sampling session."""
    now = time.time()
    sampler_id = f"{model.session_id}:sample:{save.sampling_session_seq_id}"
    directory = ephemeral_dir(ctx.data_dir, op.model_id, sampler_id)
    with storage.atomic_dir(directory) as tmp:
        size = await ctx.call(ctx.engine.export_adapter, op.model_id, tmp)
    inflight = save.sampler_kind == pb.SAMPLER_KIND_INFLIGHT
    sampler = SamplerRecord(
        sampler_id=sampler_id,
        owner=owner,
        session_id=model.session_id,
        base_model=model.base_model,
        adapter_dir=str(directory),
        adapter_id=sampler_id,
        created=now,
        inflight_model=op.model_id if inflight else None,
        min_version=op.seq_id if inflight else 0,
    )
    # An inflight save also becomes the model's shared target, versioned by its seq_id.
    target = (
        InflightTarget(op.model_id, op.seq_id, sampler_id, str(directory), now)
        if inflight
        else None
    )
    result = pb.SaveResult(sampling_session_id=sampler_id, size_bytes=size)
    return Outcome(
        pb.JobResult(save=result), sampler=sampler, adapter_dir=directory, inflight=target
    )


async def _checkpoint(ctx: RunContext, op: QueuedOp, save: pb.SaveWeights) -> Outcome:
    """A named checkpoint: training state, sampler or external weights."""
    now = time.time()
    path = TinkerPath(op.model_id, _SEGMENTS[save.kind], save.name)
    existing = await ctx.store.checkpoints.get(op.model_id, path.checkpoint_id)
    if existing is not None and not save.overwrite:
        raise UserInputError("path", f"checkpoint {path} already exists (pass overwrite)")
    directory = checkpoint_dir(ctx.data_dir, path)
    with storage.atomic_dir(directory) as tmp:
        if save.kind == pb.CHECKPOINT_KIND_TRAINING:
            size = await ctx.call(ctx.engine.save_state, op.model_id, tmp, True)
        else:
            size = await ctx.call(ctx.engine.export_adapter, op.model_id, tmp)
        if save.age_recipients:  # encrypted before it is renamed in: no plaintext checkpoint
            recipients = encryption.parse_recipients(list(save.age_recipients))
            size = await asyncio.to_thread(encryption.encrypt_tree, tmp, recipients)
    record = CheckpointRecord(
        checkpoint_id=path.checkpoint_id,
        checkpoint_type=path.checkpoint_type,
        tinker_path=str(path),
        directory=str(directory),
        time=now,
        size_bytes=size,
        expires_at=now + save.ttl_seconds if save.HasField("ttl_seconds") else None,
        user_metadata=dict(save.user_metadata),
    )
    result = pb.SaveResult(path=str(path), size_bytes=size)
    publish = directory if save.kind == pb.CHECKPOINT_KIND_SAMPLER else None
    return Outcome(pb.JobResult(save=result), checkpoint=record, adapter_dir=publish)
