"""Jobs: every request's hash (what it is, its payload, its outcome), claimed exactly once.

A (model, seq_id) or (sampling session, seq_id) claim is one script (`claims`), so a retried
request finds the first request id instead of being queued twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from lockstep.scheduler.state import claims, keys
from lockstep.scheduler.state.claims import TrainingClaim, new_request_id
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import ErrorCategory, JobStatus, OpKind


@dataclass
class Job:
    request_id: str
    kind: str
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


class Jobs:
    def __init__(self, redis: Any, result_ttl_s: int) -> None:
        self.redis = redis
        self.result_ttl_s = result_ttl_s  # Limits.future_ttl_s

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
        self,
        *,
        owner: str,
        sampler_id: str,
        seq_id: int,
        payload: bytes,
        backlog: int = 0,
        live_session: str | None = None,
        request_id: str | None = None,
    ) -> tuple[str, bool]:
        """Queue a sample request exactly once (as `request_id` if it is new); QueueFull past
        `backlog` queued samples; with `live_session`, NotLive unless the sampler exists and
        that session has not ended."""
        return await claims.claim_sample(
            self.redis,
            owner=owner,
            sampler_id=sampler_id,
            seq_id=seq_id,
            payload=payload,
            backlog=backlog,
            ttl_s=self.result_ttl_s,
            live_session=live_session,
            request_id=request_id,
        )

    async def get(self, request_id: str, payload: bool = True) -> Job | None:
        """The job; without its payload (`payload=False`: futures only need the outcome, and a
        forward_backward's payload can be megabytes read on every poll)."""
        if payload:
            raw = await self.redis.hgetall(keys.job(request_id))
            f = {k.decode(): v for k, v in raw.items()}
        else:
            values = await self.redis.hmget(keys.job(request_id), JOB_OUTCOME_FIELDS)
            f = {k: v for k, v in zip(JOB_OUTCOME_FIELDS, values, strict=True) if v is not None}
        return job_from(request_id, f) if f else None

    async def get_many(self, request_ids: list[str]) -> list[Job]:
        """The jobs that exist, payloads included, in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid in request_ids:
                pipe.hgetall(keys.job(rid))
            raws = await pipe.execute()
        return [
            job_from(rid, {k.decode(): v for k, v in raw.items()})
            for rid, raw in zip(request_ids, raws, strict=True)
            if raw
        ]

    async def finished(
        self, kind: str, owner: str, result: pb.JobResult, model_id: str = ""
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


def job_from(request_id: str, f: dict[str, bytes]) -> Job:
    """A job from its hash fields (all or some of them)."""

    def text(name: str) -> str | None:
        return f[name].decode() if name in f else None

    return Job(
        request_id=request_id,
        kind=text("kind") or OpKind.SAMPLE,
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
