"""A sampling session's futures in Redis: finishing and cancelling samples, the completion log
that the SDK's session poller reads (`retrieve_futures`), and clone ids for joining clients.

Every sample finishes exactly once, through FINISH: a cancel and the sampling lane may race
(the lane still running a sample its client just cancelled), and whichever writes first wins;
the other only takes the request off the queue. The finish also appends one entry to the log of
the sample's (sampling session, clone), in the same script, so a poller never misses one.

The SDK numbers a clone's samples from clone * 1e9 (an unpickled SamplingClient), and polls the
completions of its own clone only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from enum import IntEnum, StrEnum

from lockstep.scheduler.state import keys
from lockstep.scheduler.state.batch import WriteBatch
from lockstep.scheduler.state.jobs import Job, job_from
from lockstep.scheduler.state.outcome import Recorded
from lockstep.scheduler.state.scripts import FREES, WRITES
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import ErrorCategory, JobStatus

# The SDK's clone numbering: a client's seq_ids are clone * CLONE_SPAN + n.
CLONE_SPAN = 1_000_000_000
# Completions handed out per poll (the rest come on the next one, at once).
MAX_PER_POLL = 1000
# Result bytes a poll sends along with its completions (what the SDK's retrieve_future of each
# will ask for next: the gateway answers those itself); the rest are fetched as usual.
PREFETCH_BYTES_PER_POLL = 4 << 20
# The job fields a prefetched answer is made of.
_ANSWER_FIELDS = ("status", "result", "error", "category")
# Completions one log keeps unacknowledged. A client that waits per request (older SDKs,
# --sample-polling per-request) never acknowledges any; a session poller acknowledges on every
# poll and is never this far behind (the sample queue itself holds at most 20000 by default).
MAX_LOGGED = 100_000

# KEYS: job, sample queue, completion log, its cursor. ARGV: request id, status, ttl,
# result ("" = none), error ("" = none), category, log state, payload bytes, log length cap.
# Returns the completion's place in the log (its cursor), 0 if the job had an outcome already.
_FINISH = (
    WRITES
    + """
redis.call('LREM', KEYS[2], 1, ARGV[1])
if redis.call('HGET', KEYS[1], 'status') ~= 'pending' then
  return 0
end
redis.call('HSET', KEYS[1], 'status', ARGV[2])
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'result', ARGV[4]) end
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[5], 'category', ARGV[6]) end
redis.call('HDEL', KEYS[1], 'payload')
redis.call('EXPIRE', KEYS[1], ARGV[3])
local c = redis.call('INCR', KEYS[4])
redis.call('ZADD', KEYS[3], c, c .. '|' .. ARGV[7] .. '|' .. ARGV[1] .. '|' .. ARGV[8])
redis.call('ZREMRANGEBYRANK', KEYS[3], 0, -1 - tonumber(ARGV[9]))
redis.call('EXPIRE', KEYS[3], ARGV[3])
redis.call('EXPIRE', KEYS[4], ARGV[3])
return c
"""
)


class LogState(StrEnum):
    """The two completion states of the SDK's FutureCompletion."""

    FINISHED = "finished"
    FAILED = "failed"


class Outcome(IntEnum):
    """What cancelling a sample did (pb.CancelOutcome)."""

    CANCELLED = pb.CANCEL_OUTCOME_CANCELLED
    ALREADY_FINISHED = pb.CANCEL_OUTCOME_ALREADY_FINISHED
    ALREADY_FAILED = pb.CANCEL_OUTCOME_ALREADY_FAILED


class CursorAhead(ValueError):
    """A poll's prev_cursor is past every completion this session's log handed out."""


def clone_of(seq_id: int) -> int:
    return seq_id // CLONE_SPAN


def topic(sampling_session_id: str, clone: int) -> str:
    """The FutureBoard key a (sampling session, clone) poller waits on."""
    return f"sdone:{sampling_session_id}:{clone}"


def job_topic(job: Job) -> str:
    return topic(job.model_id, clone_of(job.seq_id))


def cancelled_message(request_id: str) -> str:
    return f"cancelled: request {request_id} was cancelled by its client before it finished"


async def finish(
    store: Store,
    job: Job,
    *,
    result: bytes | None = None,
    error: str | None = None,
    category: ErrorCategory = ErrorCategory.USER,
) -> bool:
    """Write a sample's outcome unless it has one (then only dequeue it). True: written."""
    (written,) = await finish_all(store, [(job, result, error)], category)
    return written


async def finish_all(
    store: Store,
    done: list[tuple[Job, bytes | None, str | None]],
    category: ErrorCategory = ErrorCategory.USER,
) -> list[bool]:
    """`finish` for each (job, result, error), in one round trip."""
    async with store.batch() as batch:
        at = queue_finish(batch, store.result_ttl_s, done, category)
    return [bool(batch.replies[i]) for i in at]


def queue_finish(
    batch: WriteBatch,
    ttl_s: int,
    done: list[tuple[Job, bytes | None, str | None]],
    category: ErrorCategory = ErrorCategory.USER,
) -> list[int]:
    """`finish` for each (job, result, error) queued on `batch` (a caller's batch: its other
    writes go in the same round trip); where each one's reply (its cursor, 0: not written)
    will be."""
    at = []
    for job, result, error in done:
        failed = error is not None
        at.append(batch.next_index())
        batch.pipe.eval(
            _FINISH,
            4,
            keys.job(job.request_id),
            keys.SAMPLE_QUEUE,
            keys.sample_done(job.model_id, clone_of(job.seq_id)),
            keys.sample_done_cursor(job.model_id, clone_of(job.seq_id)),
            job.request_id,
            JobStatus.FAILED if failed else JobStatus.DONE,
            ttl_s,
            result or b"",
            error or "",
            category,
            LogState.FAILED if failed else LogState.FINISHED,
            0 if failed else len(result or b""),
            MAX_LOGGED,
        )
    return at


async def cancel(store: Store, job: Job) -> Outcome:
    """Fail a sample that has not finished with the cancelled outcome (it leaves the queue, so
    it never runs); a finished one keeps its outcome."""
    message = cancelled_message(job.request_id)
    if await finish(store, job, error=message):
        return Outcome.CANCELLED
    status = await store.redis.hget(keys.job(job.request_id), "status")
    return Outcome.ALREADY_FINISHED if status == JobStatus.DONE.encode() else Outcome.ALREADY_FAILED


async def pending(store: Store, request_ids: list[str]) -> set[str]:
    """Which of these jobs are still pending (not finished or cancelled meanwhile)."""
    async with store.redis.pipeline(transaction=False) as pipe:
        for rid in request_ids:
            pipe.hget(keys.job(rid), "status")
        statuses = await pipe.execute()
    want = JobStatus.PENDING.encode()
    return {rid for rid, s in zip(request_ids, statuses, strict=True) if s == want}


@dataclass(frozen=True)
class Completions:
    entries: list[pb.FutureCompletion]
    cursor: int
    # The finished job (status, result, error) of each completion sent with its answer.
    answers: dict[str, Job]
    last: int  # the log's last cursor when it was read


@dataclass(frozen=True)
class Logged:
    """One completion as this process just logged it (FINISH's reply): the poll waiting on its
    log is handed it instead of reading it back."""

    cursor: int
    entry: pb.FutureCompletion
    answer: Job  # the finished job's answer fields

    def recorded(self) -> Recorded:
        """The outcome, for a future waiting on this one request."""
        a = self.answer
        return Recorded(a.status, a.result, a.error, a.category)


def logged(
    replies: list[object],
    at: list[int],
    done: list[tuple[Job, bytes | None, str | None]],
    category: ErrorCategory = ErrorCategory.USER,
) -> dict[str, list[Logged]]:
    """What a sent `queue_finish` logged, per poller topic in log order (from the batch's
    `replies`; a finish that wrote nothing logged nothing)."""
    found: dict[str, list[Logged]] = {}
    for i, (job, result, error) in zip(at, done, strict=True):
        cursor = replies[i]
        if not isinstance(cursor, int) or cursor <= 0:
            continue
        failed = error is not None
        size = 0 if failed else len(result or b"")
        entry = pb.FutureCompletion(request_id=job.request_id, failed=failed, payload_size=size)
        answer = replace(
            job,
            payload=b"",
            status=JobStatus.FAILED if failed else JobStatus.DONE,
            result=None if failed else result or b"",
            error=error,
            category=category if failed else None,
        )
        found.setdefault(job_topic(job), []).append(Logged(cursor, entry, answer))
    for items in found.values():
        items.sort(key=lambda item: item.cursor)
    return found


def handed(read: Completions, value: object) -> Completions | None:
    """The completions a wake-up handed over (`Logged`s), if they follow on straight from the
    poll's empty read (nothing logged between them by anyone else: else None, read them)."""
    if not isinstance(value, tuple) or read.entries:
        return None
    items = [item for item in value if isinstance(item, Logged)][:MAX_PER_POLL]
    if not items:
        return None
    cursors = [item.cursor for item in items]
    # The read found nothing after the poll's cursor and the log ended there (`last`).
    if read.cursor != read.last or cursors != list(range(read.last + 1, cursors[-1] + 1)):
        return None
    answers = {}
    budget = PREFETCH_BYTES_PER_POLL
    for item in items:
        size = len(item.answer.result or b"")
        if size <= budget:
            budget -= size
            answers[item.entry.request_id] = item.answer
    return Completions([item.entry for item in items], cursors[-1], answers, cursors[-1])


# One poll in one round trip. KEYS: the sampler's record, completion log, its cursor. ARGV: the
# caller, prev_cursor, most entries, prefetch budget (bytes), job key prefix. Nil: no such
# sampler of the caller's (nothing touched); else {last cursor, entries after prev_cursor, the
# answer fields of each entry (false past the prefetch budget)} once the entries at or before
# prev_cursor are dropped.
_SINCE = (
    FREES
    + """
local rec = redis.call('GET', KEYS[1])
if not rec or cjson.decode(rec)['owner'] ~= ARGV[1] then return nil end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[2])
local last = redis.call('GET', KEYS[3]) or '0'
local entries = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. ARGV[2], '+inf', 'LIMIT', 0, ARGV[3])
local budget = tonumber(ARGV[4])
local answers = {}
for i, entry in ipairs(entries) do
  local rid = string.match(entry, '^[^|]*|[^|]*|([^|]*)|')
  local f = redis.call('HMGET', ARGV[5] .. rid, 'status', 'result', 'error', 'category')
  local size = f[2] and #f[2] or 0
  if f[1] and size <= budget then
    budget = budget - size
    answers[i] = f
  else
    answers[i] = false
  end
end
return {last, entries, answers}
"""
)


async def since(
    store: Store, owner: str, sampling_session_id: str, clone: int, prev_cursor: int
) -> Completions | None:
    """The completions after `prev_cursor`, with the finished jobs of those that fit the
    prefetch budget; those at or before it are dropped (seen). None: the sampling session is
    not `owner`'s (or does not exist), and nothing was dropped."""
    found = await store.redis.eval(
        _SINCE,
        3,
        keys.sampler(sampling_session_id),
        keys.sample_done(sampling_session_id, clone),
        keys.sample_done_cursor(sampling_session_id, clone),
        owner,
        prev_cursor,
        MAX_PER_POLL,
        PREFETCH_BYTES_PER_POLL,
        keys.job(""),
    )
    if found is None:
        return None
    last_raw, raw, answer_fields = found
    last = int(last_raw)
    if prev_cursor > last:
        raise CursorAhead(
            f"{prev_cursor} is past the last completion ({last}) of sampling "
            f"session {sampling_session_id} clone {clone} (its completions expired, or the "
            "server's state was reset)"
        )
    entries = []
    answers = {}
    cursor = prev_cursor
    for item, fields in zip(raw, answer_fields, strict=True):
        at, state, rid, size = item.decode().split("|")
        cursor = int(at)
        entries.append(
            pb.FutureCompletion(
                request_id=rid, failed=state == LogState.FAILED, payload_size=int(size)
            )
        )
        if fields:  # sent along: what its retrieve_future would read
            present = zip(_ANSWER_FIELDS, fields, strict=True)
            answers[rid] = job_from(rid, {k: v for k, v in present if v is not None})
    return Completions(entries, cursor, answers, last)


async def join(store: Store, sampling_session_id: str) -> int:
    """A clone id for a new client of the session, unique in it (the original client is 0)."""
    key = keys.sampler_clients(sampling_session_id)
    async with store.redis.pipeline(transaction=True) as pipe:
        pipe.incr(key)
        pipe.expire(key, store.result_ttl_s)
        pipe.zadd(keys.SAMPLER_USES, {sampling_session_id: time.time()}, xx=True)
        counter, *_ = await pipe.execute()
    return int(counter)
