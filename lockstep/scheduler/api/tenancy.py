"""Tenancy: the end of a session frees its models' engine state; accounting answers per key.

`Tenancy` holds the settings and the logic; `tenancy_rpcs.TenancyRpcs` is the role of the gRPC
servicer that serves it. A session ends when its client closes it, when it sends
no heartbeat for `session_expiry_s`, or (for one run) on `unload_model`; its durable state
(snapshots, replay log, checkpoints) stays, so an unloaded run of a live session is restored on
its next request, while requests for an ended session get a 400.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from lockstep.config import TenancyConfig
from lockstep.errors import UserInputError
from lockstep.paths import TinkerPath, checkpoint_dir
from lockstep.scheduler.api.audit import AuditTrail
from lockstep.scheduler.observers.accounting import Accounting
from lockstep.scheduler.state import custom_losses
from lockstep.scheduler.state.catalog import Catalog
from lockstep.scheduler.state.records import CheckpointRecord, SessionRecord
from lockstep.scheduler.state.residency import Residency
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import AuditEvent, OpKind

log = logging.getLogger(__name__)
# Sampling sessions one expiry scan removes at most (the next scan takes the rest).
SAMPLER_SWEEP = 1000


class Tenancy:
    def __init__(
        self,
        config: TenancyConfig,
        store: Store,
        catalog: Catalog,
        residency: Residency,
        accounting: Accounting,
        wake_clock: Callable[[], None],
        unload_adapters: Callable[[list[str]], Awaitable[None]],
    ) -> None:
        self.config = config
        self.store = store
        self.catalog = catalog
        self.residency = residency
        self.accounting = accounting
        self.trail = AuditTrail(accounting)  # entries after the action: best effort
        self.wake_clock = wake_clock
        self.unload_adapters = unload_adapters  # the sampling lane's

    # ---------------------------------------------------------------- lifecycle
    async def session_started(self, rec: SessionRecord) -> None:
        await self.store.sessions.beat(rec.session_id, at=rec.created)
        await self.trail.record(rec.owner, AuditEvent.SESSION_CREATED, session_id=rec.session_id)

    async def heartbeat(self, session_id: str) -> None:
        await self.store.sessions.beat(session_id)

    async def end_session(self, rec: SessionRecord, event: AuditEvent) -> None:
        """Mark the session ended, free its models' engine state at the next cycle and delete
        its custom losses (a request already queued with one still has it attached)."""
        if not rec.finished:
            rec.finished = True
            await self.store.sessions.put(rec)
        await self.store.sessions.stop_beats(rec.session_id)
        losses = await custom_losses.delete_session(self.store, rec.session_id)
        models, samplers = await self.store.sessions.members(rec.session_id)
        self.residency.end(models)
        self.wake_clock()
        adapters = []
        for sampler_id in samplers:
            sampler = await self.store.samplers.get(sampler_id)
            if sampler is not None and sampler.adapter_id is not None:
                adapters.append(sampler.adapter_id)
        await self.unload_adapters(adapters)
        await self.trail.record(
            rec.owner, event, session_id=rec.session_id, models=models, custom_losses=losses
        )

    async def unload_model(self, owner: str, model_id: str) -> pb.SubmitReply:
        """Free one run's engine state; answered as an already finished future (older SDKs
        poll it). The run stays usable: its next request restores it."""
        model = await self.catalog.owned_model(owner, model_id)
        self.residency.end([model.model_id])
        self.wake_clock()
        result = pb.JobResult(unload_model=pb.UnloadModelResult(model_id=model.model_id))
        rid = await self.store.jobs.finished(OpKind.UNLOAD_MODEL, owner, result, model.model_id)
        await self.trail.record(owner, AuditEvent.MODEL_UNLOADED, model_id=model.model_id)
        return pb.SubmitReply(request_id=rid, model_id=model.model_id)

    async def expire_silent(self) -> int:
        """End every session whose last heartbeat is older than the expiry."""
        if not self.config.session_expiry_s:
            return 0
        cutoff = time.time() - self.config.session_expiry_s
        silent = await self.store.sessions.silent_since(cutoff)
        for session_id in silent:
            rec = await self.store.sessions.get(session_id)
            if rec is None:
                await self.store.sessions.stop_beats(session_id)
                continue
            log.info("session %s silent for %.0f s: ended", rec.session_id, time.time() - cutoff)
            await self.end_session(rec, AuditEvent.SESSION_EXPIRED)
        return len(silent)

    async def expire_unused_samplers(self) -> int:
        """Remove every sampling session unused for `sampler_expiry_s`: its Redis keys, its
        adapter in the sampler, and the sampler weights written for it alone (an ephemeral
        save's directory; a checkpoint's stays with the checkpoint). A model's current inflight
        target stays while it is the target (newer clients of the model sample it)."""
        if not self.config.sampler_expiry_s:
            return 0
        cutoff = time.time() - self.config.sampler_expiry_s
        removed, adapters = 0, []
        for sampler_id in await self.store.samplers.unused_since(cutoff, SAMPLER_SWEEP):
            rec = await self.store.samplers.get(sampler_id)
            if rec is not None and rec.inflight_model is not None:
                target = await self.store.checkpoints.inflight(rec.inflight_model)
                if target is not None and target.adapter_dir == rec.adapter_dir:
                    continue
            await self.store.samplers.remove(sampler_id, rec.session_id if rec else None)
            removed += 1
            if rec is None:
                continue
            if rec.adapter_id is not None:
                adapters.append(rec.adapter_id)
            directory = Path(rec.adapter_dir) if rec.adapter_dir else None
            if directory is not None and self._ephemeral(directory):
                await asyncio.to_thread(shutil.rmtree, directory, True)
        if adapters:
            await self.unload_adapters(adapters)
        if removed:
            log.info(
                "removed %d sampling sessions unused for %.0f s",
                removed,
                self.config.sampler_expiry_s,
            )
        return removed

    def _ephemeral(self, directory: Path) -> bool:
        """Sampler weights written for one sampling session (paths.ephemeral_dir)."""
        root = self.catalog.data_dir / "checkpoints"
        return directory.parent.name == "ephemeral" and root in directory.parents

    async def run_expiry(self) -> None:
        """The expiry scans, while either is on: silent sessions, unused sampling sessions."""
        spans = [s for s in (self.config.session_expiry_s, self.config.sampler_expiry_s) if s]
        if not spans:
            return
        period = max(min(min(spans) / 4, 30.0), 0.2)
        while True:
            await asyncio.sleep(period)
            for scan in (self.expire_silent, self.expire_unused_samplers):
                try:
                    await scan()
                except Exception:  # a Redis hiccup must not stop the expiry loop
                    log.exception("%s failed", scan.__name__)

    # ---------------------------------------------------------------- accounting
    async def storage_usage(self, owner: str) -> pb.StorageUsageReply:
        recs = await self.catalog.list_checkpoints(owner, None)
        return pb.StorageUsageReply(
            checkpoint_count=len(recs), size_bytes=sum(r.size_bytes for r in recs)
        )

    async def search_sessions(self, req: pb.SearchSessionsRequest) -> pb.SessionSummaryList:
        ids, _ = await self.store.sessions.of_owner(req.owner, 0, 1 << 30)
        limit = req.limit or 50
        out: list[pb.SessionSummary] = []
        for sid in ids:  # newest first
            rec = await self.store.sessions.get(sid)
            if rec is None or not self._matches(rec, req):
                continue
            if req.HasField("before_created") and (rec.created, rec.session_id) >= (
                req.before_created,
                req.before_session_id,
            ):
                continue
            if len(out) == limit:
                return pb.SessionSummaryList(sessions=out, more=True)
            out.append(await self._summary(rec))
        return pb.SessionSummaryList(sessions=out, more=False)

    @staticmethod
    def _matches(rec: SessionRecord, req: pb.SearchSessionsRequest) -> bool:
        status = "client_finished" if rec.finished else "active"
        if req.statuses and status not in req.statuses:
            return False
        if any(rec.user_metadata.get(k) != v for k, v in req.user_metadata.items()):
            return False
        by_id = req.HasField("session_id")
        by_name = req.HasField("display_name")
        if not (by_id or by_name):
            return True
        name = (rec.display_name or "").lower()
        return (by_id and rec.session_id == req.session_id) or (
            by_name and all(w in name for w in req.display_name.lower().split())
        )

    async def _summary(self, rec: SessionRecord) -> pb.SessionSummary:
        models, _ = await self.store.sessions.members(rec.session_id)
        count = size = 0
        for m in models:
            for c in await self.store.checkpoints.of_run(m):
                count += 1
                size += c.size_bytes
        s = pb.SessionSummary(
            session_id=rec.session_id,
            created=rec.created,
            status="client_finished" if rec.finished else "active",
            checkpoints_count=count,
            user_metadata=rec.user_metadata,
            checkpoint_storage_bytes=size,
        )
        if rec.display_name is not None:
            s.display_name = rec.display_name
        if rec.project_id is not None:
            s.project_id = rec.project_id
        return s

    async def copy_weights(self, req: pb.CopyWeightsRequest) -> pb.CopyWeightsReply:
        """A checkpoint the caller may read, copied (files and record) into a run it owns."""
        if not (req.HasField("session_id") and req.HasField("model_seq_id")):
            raise UserInputError(
                "session_id",
                "give session_id and model_seq_id of your training run to copy into "
                "(projects are not served here)",
            )
        source = TinkerPath.parse(req.source_path, "source_path")
        src = await self.catalog.readable_checkpoint(req.owner, source, field="source_path")
        dest_id = f"{req.session_id}:train:{req.model_seq_id}"
        await self.catalog.owned_model(req.owner, dest_id)
        if dest_id == source.model_id:
            raise UserInputError("model_seq_id", "the checkpoint already belongs to this run")
        if req.HasField("ttl_seconds") and req.ttl_seconds < 3600:
            raise UserInputError("ttl_seconds", "must be at least 3600 (or absent)")
        dest = TinkerPath(dest_id, source.segment, source.name)
        if await self.store.checkpoints.get(dest_id, dest.checkpoint_id) is not None:
            raise UserInputError("source_path", f"{dest} already exists in the destination run")
        directory = checkpoint_dir(self.catalog.data_dir, dest)
        await asyncio.to_thread(shutil.copytree, Path(src.directory), directory)
        now = time.time()
        rec = CheckpointRecord(
            checkpoint_id=dest.checkpoint_id,
            checkpoint_type=dest.checkpoint_type,
            tinker_path=str(dest),
            directory=str(directory),
            time=now,
            size_bytes=src.size_bytes,
            expires_at=now + req.ttl_seconds if req.HasField("ttl_seconds") else None,
            user_metadata=dict(src.user_metadata),
        )
        await self.store.checkpoints.put(dest_id, rec)
        await self.trail.record(
            req.owner, AuditEvent.CHECKPOINT_COPIED, source=req.source_path, tinker_path=str(dest)
        )
        return pb.CopyWeightsReply(tinker_path=str(dest))


def details(entry: pb.AuditEntry) -> dict[str, Any]:
    return dict(json.loads(entry.details_json or "{}"))
