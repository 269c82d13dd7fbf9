"""Durable scheduler state in Redis: jobs, futures, sessions, models, samplers, checkpoints.

Only the scheduler process writes here. Every key comes from `keys`; every record type from
`records`. Submissions are exactly-once: a (model, seq_id) claim is taken under WATCH/MULTI, so a
retried request finds the first request id instead of enqueueing twice.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from lockstep.scheduler import keys, redis_conn
from lockstep.scheduler.commit import ADVANCE_INFLIGHT, commit_op, mark_snapshot, progress_of
from lockstep.scheduler.outcome import Outcome
from lockstep.scheduler.records import (
    CheckpointRecord,
    InflightTarget,
    ModelRecord,
    QueuedOp,
    SamplerRecord,
    SessionRecord,
    decode,
    encoder,
)
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import ErrorCategory, JobStatus, OpKind

R = TypeVar("R")

# Completed futures stay retrievable this long (the SDK may re-poll after a transport error).
RESULT_TTL_SECONDS = 7 * 24 * 3600
# Drop a model from the active set only if its pending queue is (still) empty, atomically.
_SREM_IF_IDLE = """
if redis.call('ZCARD', KEYS[2]) == 0 then
  return redis.call('SREM', KEYS[1], ARGV[1])
end
return 0
"""

# Replace the inflight target only with a newer version (cjson reads the stored record).


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


def digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


@dataclass
class Job:
    request_id: str
    kind: OpKind
    owner: str
    model_id: str
    seq_id: int
    digest: str
    payload: bytes
    status: JobStatus
    result: bytes | None
    error: str | None
    category: ErrorCategory | None
    tokens: int


# Every field of a job hash but its payload.
JOB_OUTCOME_FIELDS = (
    "kind",
    "owner",
    "model_id",
    "seq_id",
    "digest",
    "status",
    "result",
    "error",
    "category",
    "tokens",
)


class ClaimConflict(Exception):
    """A different payload was submitted under an already used (model, seq_id)."""


class TenantLimitReached(Exception):
    """A new training run would pass a tenant quota (Limits.max_tenants[_per_key])."""

    def __init__(self, limit: str, count: int, most: int) -> None:
        super().__init__(f"{limit}: {count} runs, at most {most}")
        self.limit, self.count, self.most = limit, count, most


class Store:
    def __init__(self, client: aioredis.Redis, result_ttl_s: int = RESULT_TTL_SECONDS) -> None:
        # redis-py types every reply as a bytes|str|int union; with decode_responses=False it is
        # always bytes, so the client is used untyped here.
        self.redis: Any = client
        self.result_ttl_s = result_ttl_s  # Limits.future_ttl_s

    @classmethod
    def from_url(cls, url: str, result_ttl_s: int = RESULT_TTL_SECONDS) -> Store:
        return cls(redis_conn.connect(url), result_ttl_s)

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def close(self) -> None:
        await self.redis.aclose()

    # ------------------------------------------------------------------ records
    async def _get(self, key: str, kind: type[R]) -> R | None:
        raw = await self.redis.get(key)
        return None if raw is None else decode(raw, kind)

    async def put_session(self, rec: SessionRecord) -> None:
        await self.redis.set(keys.session(rec.session_id), encoder.encode(rec))

    async def new_session(self, rec: SessionRecord) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.session(rec.session_id), encoder.encode(rec))
            pipe.zadd(keys.owner_sessions(rec.owner), {rec.session_id: rec.created})
            await pipe.execute()

    async def session(self, session_id: str) -> SessionRecord | None:
        return await self._get(keys.session(session_id), SessionRecord)

    async def owner_sessions(self, owner: str, offset: int, limit: int) -> tuple[list[str], int]:
        key = keys.owner_sessions(owner)
        ids = await self.redis.zrevrange(key, offset, offset + max(limit, 1) - 1)
        return [i.decode() for i in ids], int(await self.redis.zcard(key))

    async def session_members(self, session_id: str) -> tuple[list[str], list[str]]:
        models = await self.redis.smembers(keys.session_models(session_id))
        samplers = await self.redis.smembers(keys.session_samplers(session_id))
        return sorted(m.decode() for m in models), sorted(s.decode() for s in samplers)

    async def put_model(self, rec: ModelRecord) -> None:
        await self.redis.set(keys.model(rec.model_id), encoder.encode(rec))

    async def model(self, model_id: str) -> ModelRecord | None:
        return await self._get(keys.model(model_id), ModelRecord)

    async def owner_runs(self, owner: str, offset: int, limit: int) -> tuple[list[str], int]:
        key = keys.owner_runs(owner)
        ids = await self.redis.zrevrange(key, offset, offset + max(limit, 1) - 1)
        return [i.decode() for i in ids], int(await self.redis.zcard(key))

    async def all_owner_runs(self, owner: str) -> list[str]:
        return [i.decode() for i in await self.redis.zrevrange(keys.owner_runs(owner), 0, -1)]

    async def put_sampler(self, rec: SamplerRecord) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.sampler(rec.sampler_id), encoder.encode(rec))
            pipe.sadd(keys.session_samplers(rec.session_id), rec.sampler_id)
            await pipe.execute()

    async def sampler(self, sampler_id: str) -> SamplerRecord | None:
        return await self._get(keys.sampler(sampler_id), SamplerRecord)

    # ------------------------------------------------------------------ checkpoints
    async def advance_inflight_target(self, target: InflightTarget) -> bool:
        """Point the model's inflight target at `target` unless it already holds that version or
        a newer one (versions only move forward). Returns whether it moved."""
        moved = await self.redis.eval(
            ADVANCE_INFLIGHT,
            1,
            keys.inflight_target(target.model_id),
            target.version,
            encoder.encode(target),
        )
        return bool(moved)

    async def inflight_target(self, model_id: str) -> InflightTarget | None:
        return await self._get(keys.inflight_target(model_id), InflightTarget)

    async def put_checkpoint(self, model_id: str, rec: CheckpointRecord) -> None:
        await self.redis.hset(keys.checkpoints(model_id), rec.checkpoint_id, encoder.encode(rec))

    async def checkpoint(self, model_id: str, checkpoint_id: str) -> CheckpointRecord | None:
        raw = await self.redis.hget(keys.checkpoints(model_id), checkpoint_id)
        return None if raw is None else decode(raw, CheckpointRecord)

    async def checkpoints(self, model_id: str) -> list[CheckpointRecord]:
        raw = await self.redis.hgetall(keys.checkpoints(model_id))
        recs = [decode(v, CheckpointRecord) for v in raw.values()]
        return sorted(recs, key=lambda r: r.time)

    async def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> bool:
        return bool(await self.redis.hdel(keys.checkpoints(model_id), checkpoint_id))

    # ------------------------------------------------------------------ submissions
    async def claim_training(
        self,
        *,
        owner: str,
        model_id: str,
        seq_id: int,
        kind: OpKind,
        payload: bytes,
        tokens: int,
        new_model: ModelRecord | None = None,
        rejection: str | None = None,
        identity: bytes | None = None,
        max_runs_per_key: int = 0,
        max_runs: int = 0,
    ) -> tuple[str, bool]:
        """Enqueue a training request exactly once.

        With `rejection`, the request is recorded as failed (kind REJECTED) but still takes its
        place in the model's queue, so the seq_ids after it are not held back.

        Returns (request_id, created). A retry with the same payload returns the first request id
        with created=False; a different payload under the same key raises ClaimConflict.
        `new_model` is written in the same transaction (create_model / create-via-load).
        `identity` (default: the payload) is what a retry must repeat to count as the same request.
        A `new_model` is refused with TenantLimitReached when its key already has
        `max_runs_per_key` runs or the server `max_runs` (0 = no limit). The counts are read
        under the same WATCH as the claim, so concurrent creations cannot overshoot: if another
        run is created between the read and the write, the transaction retries and re-counts.
        """
        claim = keys.seq_claim(model_id, seq_id)
        want = digest(payload if identity is None else identity)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    if new_model is None:
                        await pipe.watch(claim)
                    else:
                        await pipe.watch(claim, keys.owner_runs(owner), keys.ALL_MODELS)
                    existing = await pipe.get(claim)
                    if existing is not None:
                        rid = existing.decode()
                        old = await self.redis.hget(keys.job(rid), "digest")
                        if old is not None and old.decode() != want:
                            raise ClaimConflict(rid)
                        return rid, False
                    if new_model is not None:
                        await self._check_run_quota(pipe, owner, max_runs_per_key, max_runs)
                    rid = new_request_id()
                    pipe.multi()
                    pipe.set(claim, rid)
                    fields = self._job_fields(
                        rid, kind, owner, model_id, seq_id, want, payload, tokens
                    )
                    if rejection is not None:
                        fields.update(
                            kind=OpKind.REJECTED,
                            status=JobStatus.FAILED,
                            error=rejection,
                            category=ErrorCategory.USER,
                            payload=b"",
                        )
                    pipe.hset(keys.job(rid), mapping=fields)
                    pipe.zadd(keys.pending(model_id), {rid: seq_id})
                    pipe.sadd(keys.ACTIVE_MODELS, model_id)
                    if new_model is not None:
                        pipe.set(keys.model(model_id), encoder.encode(new_model))
                        pipe.sadd(keys.session_models(new_model.session_id), model_id)
                        pipe.zadd(keys.owner_runs(owner), {model_id: new_model.created})
                        pipe.sadd(keys.ALL_MODELS, model_id)
                    await pipe.execute()
                    return rid, True
                except WatchError:
                    continue

    @staticmethod
    async def _check_run_quota(pipe: Any, owner: str, per_key: int, total: int) -> None:
        """Inside claim_training's WATCH (the pipeline still runs commands immediately)."""
        if per_key and (mine := int(await pipe.zcard(keys.owner_runs(owner)))) >= per_key:
            raise TenantLimitReached("max_tenants_per_key", mine, per_key)
        if total and (everyone := int(await pipe.scard(keys.ALL_MODELS))) >= total:
            raise TenantLimitReached("max_tenants", everyone, total)

    async def claim_sample(
        self, *, owner: str, sampler_id: str, seq_id: int, payload: bytes
    ) -> tuple[str, bool]:
        claim = keys.sample_claim(sampler_id, seq_id)
        want = digest(payload)
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(claim)
                    existing = await pipe.get(claim)
                    if existing is not None:
                        rid = existing.decode()
                        old = await self.redis.hget(keys.job(rid), "digest")
                        if old is not None and old.decode() != want:
                            raise ClaimConflict(rid)
                        return rid, False
                    rid = new_request_id()
                    pipe.multi()
                    pipe.set(claim, rid, ex=self.result_ttl_s)
                    pipe.hset(
                        keys.job(rid),
                        mapping=self._job_fields(
                            rid, "sample", owner, sampler_id, seq_id, want, payload, 0
                        ),
                    )
                    pipe.rpush(keys.SAMPLE_QUEUE, rid)
                    await pipe.execute()
                    return rid, True
                except WatchError:
                    continue

    @staticmethod
    def _job_fields(
        rid: str,
        kind: str,
        owner: str,
        model_id: str,
        seq_id: int,
        want: str,
        payload: bytes,
        tokens: int,
    ) -> dict[str, bytes | str | int | float]:
        return {
            "request_id": rid,
            "kind": kind,
            "owner": owner,
            "model_id": model_id,
            "seq_id": seq_id,
            "digest": want,
            "payload": payload,
            "status": "pending",
            "tokens": tokens,
            "created": time.time(),
        }

    async def job(self, request_id: str, payload: bool = True) -> Job | None:
        """The job; without its payload (`payload=False`: futures only need the outcome, and a
        forward_backward's payload can be megabytes read on every poll)."""
        if payload:
            raw = await self.redis.hgetall(keys.job(request_id))
            f = {k.decode(): v for k, v in raw.items()}
        else:
            values = await self.redis.hmget(keys.job(request_id), JOB_OUTCOME_FIELDS)
            f = {k: v for k, v in zip(JOB_OUTCOME_FIELDS, values, strict=True) if v is not None}
        if not f:
            return None
        text = lambda name: f[name].decode() if name in f else None  # noqa: E731
        return Job(
            request_id=request_id,
            kind=OpKind(text("kind") or OpKind.SAMPLE),
            owner=text("owner") or "",
            model_id=text("model_id") or "",
            seq_id=int(f.get("seq_id", b"0")),
            digest=text("digest") or "",
            payload=f.get("payload", b""),
            status=JobStatus(text("status") or JobStatus.PENDING),
            result=f.get("result"),
            error=text("error"),
            category=ErrorCategory(f["category"].decode()) if "category" in f else None,
            tokens=int(f.get("tokens", b"0")),
        )

    async def jobs(self, request_ids: list[str]) -> list[Job]:
        out = []
        for rid in request_ids:
            job = await self.job(rid)
            if job is not None:
                out.append(job)
        return out

    # ------------------------------------------------------------------ the clock's view
    async def queued_ops(self) -> tuple[dict[str, list[QueuedOp]], dict[str, int]]:
        """Every active model's queued requests in seq order, and each model's next seq_id."""
        model_ids = sorted(m.decode() for m in await self.redis.smembers(keys.ACTIVE_MODELS))
        queues: dict[str, list[QueuedOp]] = {}
        next_seq: dict[str, int] = {}
        for model_id in model_ids:
            entries = await self.redis.zrange(keys.pending(model_id), 0, -1, withscores=True)
            rec = await self.model(model_id)
            if rec is None:
                await self.redis.srem(keys.ACTIVE_MODELS, model_id)
                continue
            if not entries:
                # Only while still idle: a request claimed since the ZRANGE above (it re-adds the
                # model) must keep it active, or it would wait for the model's next submission.
                await self.redis.eval(
                    _SREM_IF_IDLE, 2, keys.ACTIVE_MODELS, keys.pending(model_id), model_id
                )
                continue
            ops: list[QueuedOp] = []
            async with self.redis.pipeline(transaction=False) as pipe:
                for rid, _ in entries:
                    pipe.hmget(keys.job(rid.decode()), ["kind", "tokens"])
                fields = await pipe.execute()
            for (rid, seq), (kind, tokens) in zip(entries, fields, strict=True):
                # A queue entry whose job record is gone can never run: it holds its seq_id
                # like a rejected request instead of stalling the model behind it forever.
                known = OpKind(kind.decode()) if kind else OpKind.REJECTED
                ops.append(QueuedOp(rid.decode(), model_id, int(seq), known, int(tokens or 0)))
            queues[model_id] = ops
            next_seq[model_id] = (await self.progress(model_id))[0]
        return queues, next_seq

    async def owners(self, model_ids: list[str]) -> dict[str, str]:
        """The API key (owner) of each model that still exists (the per-key cycle quota)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for model_id in model_ids:
                pipe.get(keys.model(model_id))
            raw = await pipe.execute()
        return {
            m: decode(r, ModelRecord).owner
            for m, r in zip(model_ids, raw, strict=True)
            if r is not None
        }

    async def next_cycle(self) -> int:
        return int(await self.redis.incr(keys.CLOCK))

    async def progress(self, model_id: str) -> tuple[int, int | None]:
        """(next_seq, snapshot_seq) of a model."""
        return progress_of(
            await self.redis.hmget(keys.progress(model_id), ["next_seq", "snapshot_seq"])
        )

    async def commit(self, op: QueuedOp, outcome: Outcome) -> bool:
        """Record one op's outcome in ONE transaction (`commit.commit_op`); progress only moves
        forward. False: the op was committed already."""
        return await commit_op(self.redis, self.result_ttl_s, op, outcome)

    async def mark_snapshot(self, model_id: str, seq: int) -> int:
        """Record a snapshot finished in the background (`commit.mark_snapshot`)."""
        return await mark_snapshot(self.redis, self.result_ttl_s, model_id, seq)

    async def finished_job(
        self, kind: OpKind, owner: str, result: pb.JobResult, model_id: str = ""
    ) -> str:
        """Record an op that is done when asked (no queue, no clock) as a finished future, so
        clients that poll every answer find it; returns its request id."""
        rid = new_request_id()
        fields = {
            "request_id": rid,
            "kind": kind,
            "owner": owner,
            "model_id": model_id,
            "seq_id": 0,
            "status": JobStatus.DONE,
            "result": result.SerializeToString(),
            "created": time.time(),
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(keys.job(rid), mapping=fields)
            pipe.expire(keys.job(rid), self.result_ttl_s)
            await pipe.execute()
        return rid

    async def replay_log(self, model_id: str, after_seq: int) -> list[Job]:
        """The passes and steps to re-run, in seq order, on the snapshot taken at `after_seq`."""
        ids = await self.redis.zrangebyscore(keys.replay(model_id), f"({after_seq}", "+inf")
        return await self.jobs([i.decode() for i in ids])

    async def last_request_time(self, model_id: str) -> float | None:
        raw = await self.redis.hget(keys.progress(model_id), "last_request_time")
        return None if raw is None else float(raw)

    async def pending_count(self, model_id: str) -> int:
        return int(await self.redis.zcard(keys.pending(model_id)))

    async def sample_backlog(self) -> int:
        return int(await self.redis.llen(keys.SAMPLE_QUEUE))

    async def queued_samples(self, limit: int) -> list[str]:
        return [r.decode() for r in await self.redis.lrange(keys.SAMPLE_QUEUE, 0, limit - 1)]
