"""Tenancy's RPCs: the session lifecycle (create, heartbeat, finish), unload_model, storage and
usage per key, the audit log, session search, copy_weights, and the checkpoint calls that leave
an audit entry (delete, publish, TTL, file downloads)."""

from __future__ import annotations

import time
from collections.abc import Mapping

from lockstep.scheduler.api.servicer import Handler
from lockstep.scheduler.api.tenancy import Tenancy
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import AuditEvent


class TenancyRpcs:
    def __init__(self, tenancy: Tenancy) -> None:
        self.tenancy = tenancy
        self.catalog = tenancy.catalog
        self.trail = tenancy.trail

    def rpcs(self) -> Mapping[str, Handler]:
        t = self.tenancy
        return {
            "CreateSession": self.create_session,
            "Heartbeat": self.heartbeat,
            "FinishSession": self.finish_session,
            "UnloadModel": self.unload_model,
            "StorageUsage": lambda r: t.storage_usage(r.owner),
            "Usage": self.usage,
            "AuditLog": self.audit_log,
            "SearchSessions": t.search_sessions,
            "CopyWeights": t.copy_weights,
            "DeleteCheckpoint": self.delete_checkpoint,
            "SetCheckpointPublic": self.set_checkpoint_public,
            "SetCheckpointTtl": self.set_checkpoint_ttl,
            "GetCheckpointFiles": self.checkpoint_files,
        }

    # ---------------------------------------------------------------- lifecycle
    async def create_session(self, request: pb.CreateSessionRequest) -> pb.CreateSessionReply:
        rec = await self.catalog.create_session(
            request.owner,
            list(request.tags),
            dict(request.user_metadata),
            request.display_name if request.HasField("display_name") else None,
            request.project_id if request.HasField("project_id") else None,
        )
        await self.tenancy.session_started(rec)
        return pb.CreateSessionReply(session_id=rec.session_id)

    async def heartbeat(self, request: pb.SessionRef) -> pb.HeartbeatReply:
        finished = await self.catalog.heartbeat(request.owner, request.session_id)
        if not finished:
            await self.tenancy.heartbeat(request.session_id)
        return pb.HeartbeatReply(finished=finished)

    async def finish_session(self, request: pb.SessionRef) -> pb.Empty:
        rec = await self.catalog.owned_session(request.owner, request.session_id)
        await self.tenancy.end_session(rec, AuditEvent.SESSION_FINISHED)
        return pb.Empty()

    async def unload_model(self, request: pb.ModelRef) -> pb.SubmitReply:
        return await self.tenancy.unload_model(request.owner, request.model_id)

    # ---------------------------------------------------------------- accounting
    async def usage(self, request: pb.UsageRequest) -> pb.UsageReply:
        accounting = self.tenancy.accounting
        owners = [request.owner]
        if request.all_owners:  # an admin key: every owner's
            owners = await self.tenancy.store.sessions.owners()
        buckets = []
        for owner in owners:
            buckets += await accounting.usage(owner, request.start, request.end)
        return pb.UsageReply(buckets=buckets)

    async def audit_log(self, request: pb.AuditLogRequest) -> pb.AuditLogReply:
        accounting = self.tenancy.accounting
        entries = await accounting.audit_log(request.owner, request.start, request.end)
        return pb.AuditLogReply(entries=entries)

    # ---------------------------------------------------------------- audited checkpoint calls
    async def delete_checkpoint(self, request: pb.CheckpointRef) -> pb.Empty:
        await self.catalog.delete_checkpoint(request.owner, request.tinker_path)
        await self.trail.record(
            request.owner, AuditEvent.CHECKPOINT_DELETED, tinker_path=request.tinker_path
        )
        return pb.Empty()

    async def set_checkpoint_public(self, request: pb.SetCheckpointPublicRequest) -> pb.Empty:
        ref = request.ref
        await self.catalog.set_public(ref.owner, ref.tinker_path, request.public)
        event = (
            AuditEvent.CHECKPOINT_PUBLISHED if request.public else AuditEvent.CHECKPOINT_UNPUBLISHED
        )
        await self.trail.record(ref.owner, event, tinker_path=ref.tinker_path)
        return pb.Empty()

    async def set_checkpoint_ttl(self, request: pb.SetCheckpointTtlRequest) -> pb.Empty:
        ttl = request.ttl_seconds if request.HasField("ttl_seconds") else None
        await self.catalog.set_ttl(request.ref.owner, request.ref.tinker_path, ttl)
        return pb.Empty()

    async def checkpoint_files(self, request: pb.CheckpointRef) -> pb.CheckpointFiles:
        directory, files = await self.catalog.checkpoint_files(request.owner, request.tinker_path)
        await self.trail.record(
            request.owner, AuditEvent.CHECKPOINT_READ, tinker_path=request.tinker_path
        )
        return pb.CheckpointFiles(
            directory=str(directory), relative_paths=files, expires=time.time() + 3600
        )
