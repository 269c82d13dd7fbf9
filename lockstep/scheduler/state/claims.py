"""Exactly-once submission: each claim is ONE Lua script, one round trip (`Store` delegates here).

A (model, seq_id) or (sampling session, seq_id) claim maps to the request id that first used
it. The script reads the claim and, if it is free, checks the backlog and the run quotas and
writes the claim, the job, the queue entry (and a new model's records) together: a retried
request finds the first request id instead of enqueueing twice, and concurrent creations cannot
overshoot a quota (the count and the write are one atomic step).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

from lockstep.scheduler.state import keys
from lockstep.scheduler.state.records import ModelRecord, encoder
from lockstep.scheduler.state.scripts import WRITES
from lockstep.vocab import ErrorCategory, JobStatus, OpKind

# Shared by both claims. KEYS[1] claim, KEYS[2] job, KEYS[3] the queue.
# ARGV[1] request id, ARGV[2] digest, ARGV[3] backlog limit (0: none), ARGV[4] job key prefix,
# ARGV[5] claim TTL seconds (0: none); then the job's fields as name, value pairs.
# Returns {state, request id, detail}: state "existing" (detail: the first request's digest),
# "full" (detail: the queue length) or "created"; the new-model quota states come from TAIL.
_HEAD = """
local existing = redis.call('GET', KEYS[1])
if existing then
  return {'existing', existing, redis.call('HGET', ARGV[4] .. existing, 'digest') or ''}
end
"""
_WRITE_JOB = """
if tonumber(ARGV[5]) > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[5])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('HSET', KEYS[2], unpack(ARGV, FIELDS))
"""


def _refuse_past_backlog(length_command: str) -> str:
    """The backlog rule of both claims (ARGV[3] the limit, 0: none): a queue of KEYS[3] that
    already holds the limit refuses a new request ("full", with its length)."""
    return f"""
local limit = tonumber(ARGV[3])
if limit > 0 then
  local queued = redis.call('{length_command}', KEYS[3])
  if queued >= limit then return {{'full', '', tostring(queued)}} end
end
"""


def _live_check(flag: str, record: str, session: str) -> str:
    """A request on an existing model or sampler (ARGV `flag` "1") is claimed only while its
    record (KEYS `record`) exists and its session (KEYS `session`) has not ended: checked in
    the claim itself, so admission need not read them (and a session that ends meanwhile
    cannot slip a request in)."""
    return f"""
if ARGV[{flag}] == '1' then
  if redis.call('EXISTS', KEYS[{record}]) == 0 then return {{'no_record', '', ''}} end
  local session = redis.call('GET', KEYS[{session}])
  if not session then return {{'no_session', '', ''}} end
  if cjson.decode(session)['finished'] == true then return {{'ended', '', ''}} end
end
"""


# Training. KEYS[4] active models, KEYS[5] model, KEYS[6] session's models, KEYS[7] owner's
# runs, KEYS[8] all models, KEYS[9] the model's session, KEYS[10] its progress (a free claim
# below its next_seq is one that expired: "expired", detail the next_seq; the request ran long
# ago and its result is gone, and queueing it again would hold a seq_id the clock has passed).
# ARGV[6] seq_id, ARGV[7] model id,
# ARGV[8] new model record ('' if none), ARGV[9] its creation time, ARGV[10] runs per key
# limit, ARGV[11] server runs limit, ARGV[12] "1": check the model is live (_live_check).
CLAIM_TRAINING = (
    WRITES
    + _live_check("12", "5", "9")
    + _HEAD
    + """
local reached = tonumber(redis.call('HGET', KEYS[10], 'next_seq') or '0')
if tonumber(ARGV[6]) < reached then return {'expired', '', tostring(reached)} end
"""
    + _refuse_past_backlog("ZCARD")
    + """
if ARGV[8] ~= '' then
  local per_key, total = tonumber(ARGV[10]), tonumber(ARGV[11])
  local mine = redis.call('ZCARD', KEYS[7])
  if per_key > 0 and mine >= per_key then return {'max_tenants_per_key', '', tostring(mine)} end
  local everyone = redis.call('SCARD', KEYS[8])
  if total > 0 and everyone >= total then return {'max_tenants', '', tostring(everyone)} end
end
local FIELDS = 13
"""
    + _WRITE_JOB
    + """
redis.call('ZADD', KEYS[3], ARGV[6], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[7])
if ARGV[8] ~= '' then
  redis.call('SET', KEYS[5], ARGV[8])
  redis.call('SADD', KEYS[6], ARGV[7])
  redis.call('ZADD', KEYS[7], ARGV[9], ARGV[7])
  redis.call('SADD', KEYS[8], ARGV[7])
end
return {'created', ARGV[1], ''}
"""
)

# Sampling: the queue is the sampling lane's FIFO list. KEYS[4] the sampler, KEYS[5] its
# session, KEYS[6] samplers by last use; ARGV[6] "1": check the sampler is live (_live_check),
# ARGV[7] now, ARGV[8] the sampler id.
CLAIM_SAMPLE = (
    WRITES
    + _live_check("6", "4", "5")
    + _HEAD
    + _refuse_past_backlog("LLEN")
    + """
local FIELDS = 9
"""
    + _WRITE_JOB
    + """
redis.call('RPUSH', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[6], ARGV[7], ARGV[8])
return {'created', ARGV[1], ''}
"""
)


class ClaimConflict(Exception):
    """A different payload was submitted under an already used (model, seq_id)."""


class SeqExpired(Exception):
    """A (model, seq_id) whose claim expired with its result: the clock passed it long ago."""

    def __init__(self, model_id: str, seq_id: int, next_seq: int) -> None:
        super().__init__(
            f"seq_id {seq_id} of model {model_id} was used by a request whose result has "
            f"expired (a finished request's result and its seq_id are kept --future-ttl "
            f"seconds); new work takes the model's next seq_id ({next_seq})"
        )
        self.next_seq = next_seq


class TenantLimitReached(Exception):
    """A new training run would pass a tenant quota (Limits.max_tenants[_per_key])."""

    def __init__(self, limit: str, count: int, most: int) -> None:
        super().__init__(f"{limit}: {count} runs, at most {most}")
        self.limit, self.count, self.most = limit, count, most


class NotLive(Exception):
    """The claim found the model or sampler gone, or its session gone or ended (`state`:
    no_record, no_session, ended)."""

    def __init__(self, state: str) -> None:
        super().__init__(state)
        self.state = state


NOT_LIVE = ("no_record", "no_session", "ended")


class QueueFull(Exception):
    """The queue a claim would join already holds its backlog limit (come back later)."""

    def __init__(self, queued: int) -> None:
        super().__init__(f"{queued} requests queued")
        self.queued = queued


@dataclass(frozen=True)
class TrainingClaim:
    owner: str
    model_id: str
    seq_id: int
    kind: str
    payload: bytes
    tokens: int
    new_model: ModelRecord | None = None  # written with the claim (create_model, create-via-load)
    rejection: str | None = None  # recorded failed at once; still takes its place in the queue
    identity: bytes | None = None  # what a retry must repeat (default: the payload)
    backlog: int = 0  # refuse (QueueFull) when the model already has this many queued
    max_runs_per_key: int = 0
    max_runs: int = 0
    # The session of the existing model the request is for, checked live by the claim
    # (NotLive); None: no check (a new model, or a refused request holding its seq_id).
    live_session: str | None = None


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


def digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def job_fields(
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


async def claim_training(redis: Any, c: TrainingClaim) -> tuple[str, bool]:
    """Enqueue a training request exactly once; (request id, created). See `Store`."""
    rid, want = new_request_id(), digest(c.payload if c.identity is None else c.identity)
    fields = job_fields(rid, c.kind, c.owner, c.model_id, c.seq_id, want, c.payload, c.tokens)
    if c.rejection is not None:
        fields.update(
            kind=OpKind.REJECTED,
            status=JobStatus.FAILED,
            error=c.rejection,
            category=ErrorCategory.USER,
            payload=b"",
        )
    model = c.new_model
    session = model.session_id if model is not None else ""
    reply = await redis.eval(
        CLAIM_TRAINING,
        10,
        keys.seq_claim(c.model_id, c.seq_id),
        keys.job(rid),
        keys.pending(c.model_id),
        keys.ACTIVE_MODELS,
        keys.model(c.model_id),
        keys.session_models(session),
        keys.owner_runs(c.owner),
        keys.ALL_MODELS,
        keys.session(c.live_session or ""),
        keys.progress(c.model_id),
        rid,
        want,
        c.backlog,
        keys.job(""),
        0,
        c.seq_id,
        c.model_id,
        b"" if model is None else encoder.encode(model),
        0.0 if model is None else model.created,
        c.max_runs_per_key,
        c.max_runs,
        "0" if c.live_session is None else "1",
        *_flat(fields),
    )
    state, found, detail = (part.decode() for part in reply)
    if state in NOT_LIVE:
        raise NotLive(state)
    if state == "expired":
        raise SeqExpired(c.model_id, c.seq_id, int(detail))
    if state == "max_tenants_per_key":
        raise TenantLimitReached(state, int(detail), c.max_runs_per_key)
    if state == "max_tenants":
        raise TenantLimitReached(state, int(detail), c.max_runs)
    return _answer(state, found, detail, want)


async def claim_sample(
    redis: Any,
    *,
    owner: str,
    sampler_id: str,
    seq_id: int,
    payload: bytes,
    backlog: int,
    ttl_s: int,
    live_session: str | None = None,
    request_id: str | None = None,
) -> tuple[str, bool]:
    """Queue a sample request exactly once; (request id, created: its id is `request_id`, or
    a new one). The claim expires with the results (`ttl_s`). With `live_session` (the
    sampler's session), only while the sampler exists and its session has not ended (else
    NotLive)."""
    rid, want = request_id or new_request_id(), digest(payload)
    fields = job_fields(rid, OpKind.SAMPLE, owner, sampler_id, seq_id, want, payload, 0)
    reply = await redis.eval(
        CLAIM_SAMPLE,
        6,
        keys.sample_claim(sampler_id, seq_id),
        keys.job(rid),
        keys.SAMPLE_QUEUE,
        keys.sampler(sampler_id),
        keys.session(live_session or ""),
        keys.SAMPLER_USES,
        rid,
        want,
        backlog,
        keys.job(""),
        ttl_s,
        "0" if live_session is None else "1",
        time.time(),
        sampler_id,
        *_flat(fields),
    )
    state, found, detail = (part.decode() for part in reply)
    if state in NOT_LIVE:
        raise NotLive(state)
    return _answer(state, found, detail, want)


def _answer(state: str, found: str, detail: str, want: str) -> tuple[str, bool]:
    if state == "full":
        raise QueueFull(int(detail))
    if state == "existing":
        if detail and detail != want:
            raise ClaimConflict(found)
        return found, False
    return found, True


def _flat(fields: dict[str, bytes | str | int | float]) -> list[bytes | str | int | float]:
    return [part for pair in fields.items() for part in pair]
