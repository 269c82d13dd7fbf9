"""Durable scheduler state in Redis: jobs, futures, sessions, models, samplers, checkpoints.

Only the scheduler process writes here. Every key comes from `keys`; every record type from
`records`. Submissions are exactly-once: a (model, seq_id) claim is taken under WATCH/MULTI, so a
retried request finds the first request id instead of enqueueing twice.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis

from lockstep.scheduler.state import claims, commit, keys, redis_conn
from lockstep.scheduler.state.claims import TrainingClaim, new_request_id
from lockstep.scheduler.state.outcome import Outcome
from lockstep.scheduler.state.records import (
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
# A model's or sampler's record and its session's (the session id is in the record).
_WITH_SESSION = """
local model = redis.call('GET', KEYS[1])
if not model then return {false, false} end
return {model, redis.call('GET', ARGV[1] .. cjson.decode(model)['session_id'])}
"""
# The sampling lane's batch: the queue's length, then {request id, job fields, sampler record}
# per queued sample (a sample job's model_id is its sampler). ARGV: limit, job and sampler key
# prefixes.
_SAMPLE_BATCH = """
local out = {redis.call('LLEN', KEYS[1])}
for _, rid in ipairs(redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)) do
  local fields = redis.call('HGETALL', ARGV[2] .. rid)
  local sampler = false
  local owner = redis.call('HGET', ARGV[2] .. rid, 'model_id')
  if owner then sampler = redis.call('GET', ARGV[3] .. owner) end
  out[#out + 1] = {rid, fields, sampler}
end
return out
"""
# Every active model's queue in one read: {model id, next_seq, request id, seq, kind, tokens,
# ...} per model with queued requests. A model with an empty queue (or no record: it can never
# run) leaves the active set in the same atomic step, so a request claimed meanwhile (it re-adds
# the model) is never lost. ARGV: the model, pending, progress and job key prefixes.
_QUEUES = """
local out = {}
for _, m in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local entries = {}
  if redis.call('EXISTS', ARGV[1] .. m) == 1 then
    entries = redis.call('ZRANGE', ARGV[2] .. m, 0, -1, 'WITHSCORES')
  end
  if #entries == 0 then
    redis.call('SREM', KEYS[1], m)
  else
    local row = {m, redis.call('HGET', ARGV[3] .. m, 'next_seq') or '0'}
    for i = 1, #entries, 2 do
      local f = redis.call('HMGET', ARGV[4] .. entries[i], 'kind', 'tokens')
      row[#row + 1] = entries[i]
      row[#row + 1] = entries[i + 1]
      row[#row + 1] = f[1] or ''
      row[#row + 1] = f[2] or '0'
    end
    out[#out + 1] = row
  end
end
return out
"""


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

    async def model_and_session(
        self, model_id: str
    ) -> tuple[ModelRecord | None, SessionRecord | None]:
        """A model's record and its session's, in one round trip."""
        return await self._with_session(keys.model(model_id), ModelRecord)

    async def sampler_and_session(
        self, sampler_id: str
    ) -> tuple[SamplerRecord | None, SessionRecord | None]:
        """A sampler's record and its session's, in one round trip."""
        return await self._with_session(keys.sampler(sampler_id), SamplerRecord)

    async def _with_session(self, key: str, kind: type[R]) -> tuple[R | None, SessionRecord | None]:
        rec, session = await self.redis.eval(_WITH_SESSION, 1, key, keys.session(""))
        return (
            None if rec is None else decode(rec, kind),
            None if session is None else decode(session, SessionRecord),
        )

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
            commit.ADVANCE_INFLIGHT,
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
    async def claim_training(self, claim: TrainingClaim) -> tuple[str, bool]:
        """Enqueue a training request exactly once (one script, `claims`).

        With `claim.rejection`, the request is recorded as failed (kind REJECTED) but still
        takes its place in the model's queue, so the seq_ids after it are not held back.
        Returns (request_id, created). A retry with the same payload (or `identity`) returns the
        first request id with created=False; a different one under the same key raises
        ClaimConflict. A full queue raises QueueFull; a `new_model` past a run quota,
        TenantLimitReached.
        """
        return await claims.claim_training(self.redis, claim)

    async def claim_sample(
        self, *, owner: str, sampler_id: str, seq_id: int, payload: bytes, backlog: int = 0
    ) -> tuple[str, bool]:
        """Queue a sample request exactly once; QueueFull past `backlog` queued samples."""
        return await claims.claim_sample(
            self.redis,
            owner=owner,
            sampler_id=sampler_id,
            seq_id=seq_id,
            payload=payload,
            backlog=backlog,
            ttl_s=self.result_ttl_s,
        )

    async def job(self, request_id: str, payload: bool = True) -> Job | None:
        """The job; without its payload (`payload=False`: futures only need the outcome, and a
        forward_backward's payload can be megabytes read on every poll)."""
        if payload:
            raw = await self.redis.hgetall(keys.job(request_id))
            f = {k.decode(): v for k, v in raw.items()}
        else:
            values = await self.redis.hmget(keys.job(request_id), JOB_OUTCOME_FIELDS)
            f = {k: v for k, v in zip(JOB_OUTCOME_FIELDS, values, strict=True) if v is not None}
        return _job(request_id, f) if f else None

    async def jobs(self, request_ids: list[str]) -> list[Job]:
        """The jobs that exist, payloads included, in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid in request_ids:
                pipe.hgetall(keys.job(rid))
            raws = await pipe.execute()
        return [
            _job(rid, {k.decode(): v for k, v in raw.items()})
            for rid, raw in zip(request_ids, raws, strict=True)
            if raw
        ]

    # ------------------------------------------------------------------ the clock's view
    async def queued_ops(self) -> tuple[dict[str, list[QueuedOp]], dict[str, int]]:
        """Every active model's queued requests in seq order, and each model's next seq_id:
        one script, one round trip."""
        rows = await self.redis.eval(
            _QUEUES,
            1,
            keys.ACTIVE_MODELS,
            keys.model(""),
            keys.pending(""),
            keys.progress(""),
            keys.job(""),
        )
        queues: dict[str, list[QueuedOp]] = {}
        next_seq: dict[str, int] = {}
        for row in sorted(rows, key=lambda r: r[0]):
            model_id = row[0].decode()
            next_seq[model_id] = int(row[1])
            # A queue entry whose job record is gone can never run: it holds its seq_id like a
            # rejected request instead of stalling the model behind it forever.
            queues[model_id] = [
                QueuedOp(
                    rid.decode(),
                    model_id,
                    int(float(seq)),
                    OpKind(kind.decode()) if kind else OpKind.REJECTED,
                    int(tokens),
                )
                for rid, seq, kind, tokens in zip(*[iter(row[2:])] * 4, strict=True)
            ]
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

    async def begin_cycle(self, request_ids: Sequence[str]) -> tuple[int, dict[str, bytes]]:
        """The new cycle's number and the payloads of its requests, in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.incr(keys.CLOCK)
            for rid in request_ids:
                pipe.hget(keys.job(rid), "payload")
            cycle, *payloads = await pipe.execute()
        found = zip(request_ids, payloads, strict=True)
        return int(cycle), {rid: p for rid, p in found if p is not None}

    async def progress(self, model_id: str) -> tuple[int, int | None]:
        """(next_seq, snapshot_seq) of a model."""
        return commit.progress_of(
            await self.redis.hmget(keys.progress(model_id), ["next_seq", "snapshot_seq"])
        )

    async def commit_cycle(self, pairs: Sequence[tuple[QueuedOp, Outcome]]) -> list[bool]:
        """Record each op's outcome, each atomically (`commit.commit_ops`), all in one round
        trip; a model's ops come in seq_id order. False: that op was committed already."""
        return await commit.commit_ops(self.redis, self.result_ttl_s, pairs)

    async def commit(self, op: QueuedOp, outcome: Outcome) -> bool:
        """Record one op's outcome (see `commit_cycle`)."""
        return (await self.commit_cycle([(op, outcome)]))[0]

    async def mark_snapshot(self, model_id: str, seq: int) -> int:
        """Record a snapshot finished in the background (`commit.mark_snapshot`)."""
        return await commit.mark_snapshot(self.redis, self.result_ttl_s, model_id, seq)

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

    async def sample_batch(self, limit: int) -> tuple[int, list[Job], dict[str, SamplerRecord]]:
        """The sample queue's length, its first `limit` jobs (payloads included) and their
        sampler records: one script, one round trip."""
        backlog, *rows = await self.redis.eval(
            _SAMPLE_BATCH, 1, keys.SAMPLE_QUEUE, limit, keys.job(""), keys.sampler("")
        )
        jobs: list[Job] = []
        samplers: dict[str, SamplerRecord] = {}
        for rid, fields, sampler in rows:
            if not fields:
                continue
            pairs = zip(fields[::2], fields[1::2], strict=True)
            job = _job(rid.decode(), {k.decode(): v for k, v in pairs})
            jobs.append(job)
            if sampler is not None:
                samplers[job.model_id] = decode(sampler, SamplerRecord)
        return int(backlog), jobs, samplers


def _job(request_id: str, f: dict[str, bytes]) -> Job:
    """A job from its hash fields (all or some of them)."""

    def text(name: str) -> str | None:
        return f[name].decode() if name in f else None

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
