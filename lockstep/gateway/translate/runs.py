"""Training runs, checkpoints, weights info and server capabilities (REST side)."""

from __future__ import annotations

from typing import Literal

from lockstep.gateway.schema import responses as rs
from lockstep.gateway.translate.common import utc
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import RunStatus

CheckpointType = Literal["training", "sampler", "external"]
_TYPES: tuple[CheckpointType, ...] = ("training", "sampler", "external")


def checkpoint(c: pb.Checkpoint) -> rs.Checkpoint:
    kind = c.checkpoint_type if c.checkpoint_type in _TYPES else "training"
    return rs.Checkpoint(
        checkpoint_id=c.checkpoint_id,
        checkpoint_type=kind,
        time=utc(c.time),
        tinker_path=c.tinker_path,
        size_bytes=c.size_bytes or None,
        public=c.public,
        user_metadata=dict(c.user_metadata) or None,
        expires_at=utc(c.expires_at) if c.HasField("expires_at") else None,
    )


def checkpoint_list(
    reply: pb.CheckpointList, offset: int, limit: int
) -> rs.CheckpointsListResponse:
    return rs.CheckpointsListResponse(
        checkpoints=[checkpoint(c) for c in reply.checkpoints],
        cursor=rs.Cursor(offset=offset, limit=limit, total_count=reply.total_count),
    )


def training_run(r: pb.TrainingRun) -> rs.TrainingRun:
    return rs.TrainingRun(
        training_run_id=r.training_run_id,
        base_model=r.base_model,
        model_owner=r.model_owner,
        is_lora=r.is_lora,
        lora_rank=r.lora_rank or None,
        last_request_time=utc(r.last_request_time),
        last_checkpoint=checkpoint(r.last_checkpoint) if r.HasField("last_checkpoint") else None,
        last_sampler_checkpoint=(
            checkpoint(r.last_sampler_checkpoint) if r.HasField("last_sampler_checkpoint") else None
        ),
        user_metadata=dict(r.user_metadata) or None,
        steps=r.steps,
        tokens_trained=r.tokens_trained,
        status=RunStatus(r.status) if r.status else None,
        queued=r.queued,
    )


def run_history(run_id: str, h: pb.RunHistory) -> rs.RunHistoryResponse:
    return rs.RunHistoryResponse(
        training_run_id=run_id,
        steps=[
            rs.StepMetrics(
                step=s.step,
                time=utc(s.time),
                metrics=dict(s.metrics),
                datums=s.datums,
                tokens=s.tokens,
                complete=s.complete,
                steps=s.steps or 1,
            )
            for s in h.steps
        ],
        first_step=h.first_step,
    )


def run_futures(run_id: str, f: pb.RunFutures) -> rs.RunFuturesResponse:
    return rs.RunFuturesResponse(
        training_run_id=run_id,
        futures=[
            rs.QueuedFuture(request_id=q.request_id, kind=q.kind, seq_id=q.seq_id, status=q.status)
            for q in f.futures
        ],
        total_count=f.total_count,
    )


def training_run_list(
    reply: pb.TrainingRunList, offset: int, limit: int
) -> rs.TrainingRunsResponse:
    return rs.TrainingRunsResponse(
        training_runs=[training_run(r) for r in reply.runs],
        cursor=rs.Cursor(offset=offset, limit=limit, total_count=reply.total_count),
    )


def weights_info(info: pb.WeightsInfo) -> rs.WeightsInfoResponse:
    lora = info.lora_config if info.HasField("lora_config") else None
    return rs.WeightsInfoResponse(
        base_model=info.base_model,
        is_lora=info.is_lora,
        lora_rank=lora.rank if lora else None,
        train_unembed=lora.train_unembed if lora else None,
        train_mlp=lora.train_mlp if lora else None,
        train_attn=lora.train_attn if lora else None,
    )


def capabilities(caps: pb.ServerCapabilities) -> rs.ServerCapabilitiesResponse:
    return rs.ServerCapabilitiesResponse(
        supported_models=[
            rs.SupportedModel(
                model_name=m.model_name,
                max_context_length=m.max_context_length or None,
                trainable=True,
                sampleable=True,
                max_tokens_per_datum=m.max_tokens_per_datum or None,
                trainer_memory_budget_bytes=m.trainer_memory_budget_bytes or None,
                custom_loss_max_flops_per_token=m.custom_loss_max_flops_per_token or None,
                custom_loss_max_memory_bytes=m.custom_loss_max_memory_bytes or None,
                trainer_path=m.trainer_path or None,
                sampler_inputs=list(caps.engines.sampler_inputs) or None,
                trainer_kernels=dict(m.trainer_kernels) or None,
                sampler_kernels=dict(m.sampler_kernels) or None,
            )
            for m in caps.models
        ],
        lockstep_version=caps.version or None,
        state_format=caps.state_format or None,
    )
