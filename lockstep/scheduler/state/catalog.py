"""The catalog: sessions, training runs, samplers and checkpoints, scoped to their owner.

Another owner's object answers NotFound (never "forbidden"), so ids leak nothing. Published
checkpoints are readable by every owner.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from cachetools import LRUCache

from lockstep.engine.types import ModelCard
from lockstep.errors import UserInputError
from lockstep.paths import TinkerPath, checkpoint_dir
from lockstep.scheduler.state.records import (
    CheckpointRecord,
    ModelRecord,
    SamplerRecord,
    SessionRecord,
)
from lockstep.scheduler.state.store import Store


class NotFound(LookupError):
    """Reported as 404."""


class OverCapacity(RuntimeError):
    """A queue is full right now: the client should retry later (429 / try_again)."""


Addressed = TypeVar("Addressed", ModelRecord, SamplerRecord)
# Models and samplers whose owner and session one scheduler keeps in memory (a record is a few
# hundred bytes).
ADDRESSED_KEPT = 100_000


class Catalog:
    def __init__(
        self, store: Store, card: ModelCard, served_names: list[str], data_dir: Path
    ) -> None:
        self.store = store
        self.card = card
        self.served_names = served_names
        self.data_dir = data_dir
        # Models and samplers found live by this process (addressed_model, addressed_sampler):
        # their owner and session, by id (model and sampler ids never collide).
        self._addressed: LRUCache[str, ModelRecord | SamplerRecord] = LRUCache(
            maxsize=ADDRESSED_KEPT
        )

    # ------------------------------------------------------------------ base models
    def resolve_base_model(self, name: str) -> ModelCard:
        if name in self.served_names or name.rstrip("/") == self.card.directory.rstrip("/"):
            return self.card
        raise UserInputError(
            "base_model", f"{name!r} is not served here; served models: {self.served_names}"
        )

    # ------------------------------------------------------------------ sessions
    async def create_session(
        self,
        owner: str,
        tags: list[str],
        user_metadata: dict[str, str],
        display_name: str | None,
        project_id: str | None,
    ) -> SessionRecord:
        now = time.time()
        rec = SessionRecord(
            session_id=f"sess-{uuid.uuid4().hex[:12]}",
            owner=owner,
            created=now,
            last_heartbeat=now,
            user_metadata=user_metadata,
            tags=tags,
            display_name=display_name,
            project_id=project_id,
        )
        await self.store.sessions.create(rec)
        return rec

    async def owned_session(self, owner: str, session_id: str) -> SessionRecord:
        return _owned_session(await self.store.sessions.get(session_id), owner, session_id)

    async def live_session(
        self, owner: str, session_id: str, field: str = "session_id"
    ) -> SessionRecord:
        """A session that has not ended: an ended one (closed, or silent past the expiry) is a
        permanent 400, not a 404 (its runs and checkpoints still exist)."""
        rec = await self.owned_session(owner, session_id)
        return _live(rec, field)

    async def addressed_model(self, owner: str, model_id: str) -> ModelRecord:
        """A model of `owner` as this process last found it live (`live_model`, read once):
        its owner and session never change, so a request on it reads nothing here; its claim
        checks that the model still exists and its session has not ended (`claims.NotLive`,
        answered as `live_model` would by `not_live`). Only the record's owner and session
        may be relied on: the rest may be stale."""
        return await self._addressed_as(owner, model_id, ModelRecord, self.live_model, "model")

    async def addressed_sampler(self, owner: str, sampler_id: str) -> SamplerRecord:
        """`addressed_model` for a sampler (`live_sampler`, read once per process)."""
        return await self._addressed_as(
            owner, sampler_id, SamplerRecord, self.live_sampler, "sampler"
        )

    async def _addressed_as(
        self,
        owner: str,
        name: str,
        kind: type[Addressed],
        read: Callable[[str, str], Awaitable[Addressed]],
        what: str,
    ) -> Addressed:
        rec = self._addressed.get(name)
        if not isinstance(rec, kind):
            rec = await read(owner, name)
            self._addressed[name] = rec
        elif rec.owner != owner:
            raise NotFound(f"{what} {name} does not exist")
        return rec

    def not_live(self, name: str, session_id: str, state: str, sampler: bool = False) -> Exception:
        """What a claim that found model (or sampler) `name` of session `session_id` not live
        (`claims.NotLive.state`) answers: the refusal `live_model` / `live_sampler` gives."""
        self._addressed.pop(name, None)
        if state == "ended":
            return _ended(session_id, "sampling_session_id" if sampler else "model_id")
        if state == "no_session":
            return NotFound(f"session {session_id} does not exist")
        return NotFound(f"{'sampler' if sampler else 'model'} {name} does not exist")

    async def live_model(self, owner: str, model_id: str) -> ModelRecord:
        """A model of `owner` whose session has not ended (what a training request needs), read
        with its session in one round trip."""
        model, session = await self.store.runs.with_session(model_id)
        if model is None or model.owner != owner:
            raise NotFound(f"model {model_id} does not exist")
        _live(_owned_session(session, owner, model.session_id), "model_id")
        return model

    async def live_sampler(self, owner: str, sampler_id: str) -> SamplerRecord:
        """A sampler of `owner` whose session has not ended (what a sample needs), read with its
        session in one round trip."""
        sampler, session = await self.store.samplers.with_session(sampler_id)
        if sampler is None or sampler.owner != owner:
            raise NotFound(f"sampler {sampler_id} does not exist")
        _live(_owned_session(session, owner, sampler.session_id), "sampling_session_id")
        return sampler

    async def heartbeat(self, owner: str, session_id: str) -> bool:
        rec = await self.owned_session(owner, session_id)
        rec.last_heartbeat = time.time()
        await self.store.sessions.put(rec)
        return rec.finished

    # ------------------------------------------------------------------ models and samplers
    async def owned_model(self, owner: str, model_id: str, all_owners: bool = False) -> ModelRecord:
        """A model of `owner`; with `all_owners` (an admin key's read) of any owner."""
        rec = await self.store.runs.get(model_id)
        if rec is None or (rec.owner != owner and not all_owners):
            raise NotFound(f"model {model_id} does not exist")
        return rec

    async def owned_sampler(self, owner: str, sampler_id: str) -> SamplerRecord:
        rec = await self.store.samplers.get(sampler_id)
        if rec is None or rec.owner != owner:
            raise NotFound(f"sampler {sampler_id} does not exist")
        return rec

    async def create_sampler(
        self,
        owner: str,
        session_id: str,
        seq: int,
        model_path: str | None,
        base_model: str | None,
    ) -> SamplerRecord:
        session = await self.owned_session(owner, session_id)
        if seq < 0:
            raise UserInputError("sampling_session_seq_id", f"must be >= 0, got {seq}")
        sampler_id = f"{session.session_id}:sample:{seq}"
        existing = await self.store.samplers.get(sampler_id)
        if existing is not None:  # a retried create: same answer
            return existing
        if model_path:
            path = TinkerPath.parse(model_path, "model_path")
            ckpt = await self.readable_checkpoint(owner, path, field="model_path")
            source = await self.store.runs.get(path.model_id)
            rec = SamplerRecord(
                sampler_id=sampler_id,
                owner=owner,
                session_id=session.session_id,
                base_model=source.base_model if source else self.card.name,
                model_path=model_path,
                adapter_dir=ckpt.directory,
                adapter_id=f"{model_path}@{ckpt.time}",
                created=time.time(),
            )
        elif base_model:
            self.resolve_base_model(base_model)
            rec = SamplerRecord(
                sampler_id=sampler_id,
                owner=owner,
                session_id=session.session_id,
                base_model=base_model,
                created=time.time(),
            )
        else:
            raise UserInputError("model_path", "give model_path or base_model")
        await self.store.samplers.put(rec)
        return rec

    # ------------------------------------------------------------------ checkpoints
    async def readable_checkpoint(
        self, owner: str, path: TinkerPath, field: str = "path"
    ) -> CheckpointRecord:
        """A live checkpoint the owner may read (their own, or a published one)."""
        rec = await self.store.checkpoints.get(path.model_id, path.checkpoint_id)
        model = await self.store.runs.get(path.model_id)
        if rec is None or model is None or self._expired(rec):
            raise NotFound(f"checkpoint {path} does not exist")
        if model.owner != owner and not rec.public:
            raise NotFound(f"checkpoint {path} does not exist")
        return rec

    async def owned_checkpoint(self, owner: str, tinker_path: str) -> CheckpointRecord:
        path = TinkerPath.parse(tinker_path)
        await self.owned_model(owner, path.model_id)
        rec = await self.store.checkpoints.get(path.model_id, path.checkpoint_id)
        if rec is None or self._expired(rec):
            raise NotFound(f"checkpoint {tinker_path} does not exist")
        return rec

    @staticmethod
    def _expired(rec: CheckpointRecord) -> bool:
        return rec.expires_at is not None and rec.expires_at <= time.time()

    async def list_checkpoints(
        self, owner: str, run_id: str | None, all_owners: bool = False
    ) -> list[CheckpointRecord]:
        run_ids = [run_id] if run_id else await self.store.runs.all_of_owner(owner)
        out: list[CheckpointRecord] = []
        for rid in run_ids:
            await self.owned_model(owner, rid, all_owners and run_id is not None)
            for rec in await self.store.checkpoints.of_run(rid):
                if self._expired(rec):
                    await self._remove(rid, rec)
                else:
                    out.append(rec)
        return sorted(out, key=lambda r: r.time, reverse=True)

    async def delete_checkpoint(self, owner: str, tinker_path: str) -> None:
        rec = await self.owned_checkpoint(owner, tinker_path)
        await self._remove(TinkerPath.parse(tinker_path).model_id, rec)

    async def _remove(self, model_id: str, rec: CheckpointRecord) -> None:
        await self.store.checkpoints.delete(model_id, rec.checkpoint_id)
        directory = Path(rec.directory)
        if directory.is_dir() and self.data_dir in directory.parents:
            shutil.rmtree(directory, ignore_errors=True)

    async def set_public(self, owner: str, tinker_path: str, public: bool) -> None:
        rec = await self.owned_checkpoint(owner, tinker_path)
        rec.public = public
        await self.store.checkpoints.put(TinkerPath.parse(tinker_path).model_id, rec)

    async def set_ttl(self, owner: str, tinker_path: str, ttl_seconds: int | None) -> None:
        rec = await self.owned_checkpoint(owner, tinker_path)
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise UserInputError("ttl_seconds", "must be positive (or null to keep forever)")
        rec.expires_at = None if ttl_seconds is None else time.time() + ttl_seconds
        await self.store.checkpoints.put(TinkerPath.parse(tinker_path).model_id, rec)

    async def checkpoint_files(self, owner: str, tinker_path: str) -> tuple[Path, list[str]]:
        path = TinkerPath.parse(tinker_path)
        rec = await self.readable_checkpoint(owner, path)
        directory = Path(rec.directory)
        if directory != checkpoint_dir(self.data_dir, path) or not directory.is_dir():
            raise NotFound(f"checkpoint {tinker_path} has no files on this server")
        files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
        return directory, files


def _owned_session(rec: SessionRecord | None, owner: str, session_id: str) -> SessionRecord:
    if rec is None or rec.owner != owner:
        raise NotFound(f"session {session_id} does not exist")
    return rec


def _live(rec: SessionRecord, field: str) -> SessionRecord:
    if rec.finished:
        raise _ended(rec.session_id, field)
    return rec


def _ended(session_id: str, field: str) -> UserInputError:
    return UserInputError(
        field,
        f"session {session_id} has ended (closed, or no heartbeat within the expiry); "
        "its checkpoints remain: start a new session and load them",
    )
