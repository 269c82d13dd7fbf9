"""The scheduler's gRPC service with tenancy: unload a model, storage and usage per key, the
audit log, session search, copy_weights; and the lifecycle and audit entries of the session and
checkpoint calls SchedulerService serves (each override calls it, then records)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import grpc

from lockstep.scheduler.api.service import SchedulerService, grpc_errors
from lockstep.scheduler.api.tenancy import Tenancy
from lockstep.scheduler.observers.accounting import AuditEvent
from lockstep.v1 import scheduler_pb2 as pb


class TenancyService(SchedulerService):
    def __init__(self, *args: Any, tenancy: Tenancy, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tenancy = tenancy

    def _audit(self, owner: str, event: AuditEvent, **details: Any) -> Awaitable[None]:
        return self.tenancy.accounting.audit(owner, event, **details)

    # ---------------------------------------------------------------- new RPCs
    @grpc_errors
    async def UnloadModel(
        self, request: pb.ModelRef, context: grpc.aio.ServicerContext
    ) -> pb.SubmitReply:
        return await self.tenancy.unload_model(request.owner, request.model_id)

    @grpc_errors
    async def StorageUsage(
        self, request: pb.OwnerRef, context: grpc.aio.ServicerContext
    ) -> pb.StorageUsageReply:
        return await self.tenancy.storage_usage(request.owner)

    @grpc_errors
    async def Usage(
        self, request: pb.UsageRequest, context: grpc.aio.ServicerContext
    ) -> pb.UsageReply:
        buckets = await self.tenancy.accounting.usage(request.owner, request.start, request.end)
        return pb.UsageReply(buckets=buckets)

    @grpc_errors
    async def AuditLog(
        self, request: pb.AuditLogRequest, context: grpc.aio.ServicerContext
    ) -> pb.AuditLogReply:
        entries = await self.tenancy.accounting.audit_log(request.owner, request.start, request.end)
        return pb.AuditLogReply(entries=entries)

    @grpc_errors
    async def SearchSessions(
        self, request: pb.SearchSessionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.SessionSummaryList:
        return await self.tenancy.search_sessions(request)

    @grpc_errors
    async def CopyWeights(
        self, request: pb.CopyWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.CopyWeightsReply:
        return await self.tenancy.copy_weights(request)

    # ---------------------------------------------------------------- lifecycle
    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateSessionReply:
        reply = await super().CreateSession(request, context)
        rec = await self.store.session(reply.session_id)
        if rec is not None:
            await self.tenancy.session_started(rec)
        return reply

    async def Heartbeat(
        self, request: pb.SessionRef, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatReply:
        reply = await super().Heartbeat(request, context)
        if not reply.finished:
            await self.tenancy.heartbeat(request.session_id)
        return reply

    @grpc_errors
    async def FinishSession(
        self, request: pb.SessionRef, context: grpc.aio.ServicerContext
    ) -> pb.Empty:
        rec = await self.catalog.owned_session(request.owner, request.session_id)
        await self.tenancy.end_session(rec, AuditEvent.SESSION_FINISHED)
        return pb.Empty()

    # ---------------------------------------------------------------- audit of the rest
    async def Submit(
        self, request: pb.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> pb.SubmitReply:
        reply = await super().Submit(request, context)
        op = request.WhichOneof("op")
        if op == "create_model":
            await self._audit(
                request.owner, AuditEvent.TRAINING_RUN_CREATED, model_id=reply.model_id
            )
        elif op == "load_weights":
            path = request.load_weights.path
            await self._audit(
                request.owner,
                AuditEvent.CHECKPOINT_LOADED,
                tinker_path=path,
                model_id=reply.model_id,
            )
        return reply

    async def DeleteCheckpoint(
        self, request: pb.CheckpointRef, context: grpc.aio.ServicerContext
    ) -> pb.Empty:
        reply = await super().DeleteCheckpoint(request, context)
        await self._audit(
            request.owner, AuditEvent.CHECKPOINT_DELETED, tinker_path=request.tinker_path
        )
        return reply

    async def SetCheckpointPublic(
        self, request: pb.SetCheckpointPublicRequest, context: grpc.aio.ServicerContext
    ) -> pb.Empty:
        reply = await super().SetCheckpointPublic(request, context)
        event = (
            AuditEvent.CHECKPOINT_PUBLISHED if request.public else AuditEvent.CHECKPOINT_UNPUBLISHED
        )
        await self._audit(request.ref.owner, event, tinker_path=request.ref.tinker_path)
        return reply

    async def GetCheckpointFiles(
        self, request: pb.CheckpointRef, context: grpc.aio.ServicerContext
    ) -> pb.CheckpointFiles:
        reply = await super().GetCheckpointFiles(request, context)
        await self._audit(
            request.owner, AuditEvent.CHECKPOINT_READ, tinker_path=request.tinker_path
        )
        return reply
