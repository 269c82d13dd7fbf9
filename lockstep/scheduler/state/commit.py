"""How a cycle's outcomes reach Redis (`Cycles.commit` delegates here).

Each op's outcome is ONE Lua script: the job's result or error, the checkpoint / sampler /
inflight records it made, its model record, the model's progress and its replay log, all or
nothing (a crash leaves none of it; then the op runs again). A cycle sends every op's script in
one pipeline: one round trip, and one append-only-file write for the whole cycle.

Progress only moves forward, enforced inside the script and not by the order of commits:
`next_seq` = max(recorded, seq_id + 1), `snapshot_seq` likewise.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from lockstep.scheduler.state import keys
from lockstep.scheduler.state.outcome import Outcome
from lockstep.scheduler.state.records import (
    HistoryEntry,
    ModelRecord,
    QueuedOp,
    decode,
    encoder,
)
from lockstep.scheduler.state.scripts import WRITES
from lockstep.vocab import CheckpointType, JobStatus, OpKind

# The one trim rule: replay-log entries a snapshot covers leave the log and their job keeps its
# outcome only (the payload goes; it expires with the other results, and so does the claim of
# its seq_id: a retry within the retention still finds its first request).
_TRIM = """
local function trim(replay, upto, job_prefix, ttl, claim_prefix)
  local stale = redis.call('ZRANGEBYSCORE', replay, '-inf', upto, 'WITHSCORES')
  for i = 1, #stale, 2 do
    local rid, seq = stale[i], stale[i + 1]
    redis.call('ZREM', replay, rid)
    redis.call('HDEL', job_prefix .. rid, 'payload')
    redis.call('EXPIRE', job_prefix .. rid, ttl)
    redis.call('EXPIRE', claim_prefix .. seq, ttl)
  end
end
"""
# The inflight weights target of a model only moves to a newer version (compare-and-set).
_ADVANCE = """
local function advance(key, version, record)
  local current = redis.call('GET', key)
  if current and cjson.decode(current)['version'] >= tonumber(version) then return 0 end
  redis.call('SET', key, record)
  return 1
end
"""
ADVANCE_INFLIGHT = WRITES + _ADVANCE + "return advance(KEYS[1], ARGV[1], ARGV[2])"

# The ops a run's metrics history keeps (`keys.history`): the newest 20,000 forward,
# forward_backward and optim_step results (10,000 steps of two ops each, ~1 MB of Redis per run;
# runs are kept as long as their checkpoints, so this bounds what each run holds for good).
HISTORY_KEPT = 20_000
# KEYS: 1 progress, 2 pending, 3 job, 4 replay, 5 model, 6 checkpoints, 7 inflight target,
#       8 sampler, 9 session's samplers, 10 the op's seq_id claim, 11 samplers by last use,
#       12 history.
# ARGV: 1 request id, 2 seq_id, 3 the outcome's snapshot_seq ('' none), 4 now, 5 result TTL,
#       6 job key prefix, 7 replayed ('1': keep the payload in the replay log),
#       8 model record expected ('' no change), 9 model record after,
#       10 checkpoint id ('' none), 11 checkpoint record, 12 inflight version ('' none),
#       13 inflight record, 14 sampler id ('' none), 15 sampler record, 16 the model's claim
#       key prefix, 17 history entry ('' none), 18 steps it adds, 19 trained tokens it adds,
#       20.. the job's outcome fields as name, value pairs (none: a rejected op's error was
#       written at submission).
# Returns 1 committed, 0 committed already (no longer pending), -1 the model record changed
# since it was read (read it again and retry).
COMMIT_OP = (
    WRITES
    + f"local HISTORY_KEPT = {HISTORY_KEPT}\n"
    + _TRIM
    + _ADVANCE
    + """
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 0 end
if ARGV[8] ~= '' and redis.call('GET', KEYS[5]) ~= ARGV[8] then return -1 end
local seq = tonumber(ARGV[2])
local recorded = redis.call('HMGET', KEYS[1], 'next_seq', 'snapshot_seq')
local progress = {'next_seq', math.max(tonumber(recorded[1]) or 0, seq + 1),
                  'last_request_time', ARGV[4]}
local own = tonumber(ARGV[3])
if own then
  local snapshot = math.max(own, tonumber(recorded[2]) or own)
  progress[5], progress[6] = 'snapshot_seq', snapshot
  trim(KEYS[4], snapshot, ARGV[6], ARGV[5], ARGV[16])
end
if ARGV[10] ~= '' then redis.call('HSET', KEYS[6], ARGV[10], ARGV[11]) end
if ARGV[8] ~= '' then redis.call('SET', KEYS[5], ARGV[9]) end
if ARGV[12] ~= '' then advance(KEYS[7], ARGV[12], ARGV[13]) end
if ARGV[14] ~= '' then
  redis.call('SET', KEYS[8], ARGV[15])
  redis.call('SADD', KEYS[9], ARGV[14])
  redis.call('ZADD', KEYS[11], ARGV[4], ARGV[14])
end
if ARGV[17] ~= '' then
  redis.call('RPUSH', KEYS[12], ARGV[17])
  redis.call('LTRIM', KEYS[12], -HISTORY_KEPT, -1)
end
if ARGV[18] ~= '0' then redis.call('HINCRBY', KEYS[1], 'steps', ARGV[18]) end
if ARGV[19] ~= '0' then redis.call('HINCRBY', KEYS[1], 'tokens', ARGV[19]) end
if #ARGV > 19 then redis.call('HSET', KEYS[3], unpack(ARGV, 20)) end
redis.call('ZREM', KEYS[2], ARGV[1])
if ARGV[7] == '1' and not (own and seq <= own) then
  redis.call('ZADD', KEYS[4], seq, ARGV[1])
else
  redis.call('HDEL', KEYS[3], 'payload')
  redis.call('EXPIRE', KEYS[3], ARGV[5])
  redis.call('EXPIRE', KEYS[10], ARGV[5])
end
redis.call('HSET', KEYS[1], unpack(progress))
return 1
"""
)

# KEYS: 1 progress, 2 replay. ARGV: 1 seq, 2 job key prefix, 3 result TTL, 4 claim key prefix.
# Returns the mark (-1: none). Only a state the recorded progress has reached is marked: a
# snapshot of a step whose commit failed (Redis refused it) is not, and the step runs again.
MARK_SNAPSHOT = (
    WRITES
    + _TRIM
    + """
local recorded = redis.call('HMGET', KEYS[1], 'snapshot_seq', 'next_seq')
local seq, current = tonumber(ARGV[1]), tonumber(recorded[1])
if seq >= (tonumber(recorded[2]) or 0) then return current or -1 end
local mark = math.max(seq, current or seq)
redis.call('HSET', KEYS[1], 'snapshot_seq', mark)
trim(KEYS[2], mark, ARGV[2], ARGV[3], ARGV[4])
return mark
"""
)


def progress_of(raw: list[bytes | None]) -> tuple[int, int | None]:
    """(next_seq, snapshot_seq) from an HMGET of a progress hash."""
    return int(raw[0] or 0), None if raw[1] is None else int(raw[1])


# The cycle number reached: stored unless a larger one is (KEYS[1] the clock, ARGV[1] it).
_ADVANCE_CLOCK = (
    WRITES
    + """
if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return 0
"""
)


async def commit_ops(
    redis: Any,
    result_ttl_s: int,
    pairs: Sequence[tuple[QueuedOp, Outcome]],
    clock: int | None = None,
) -> list[bool]:
    """Record each op's outcome (one script per op, all in one round trip), in the order given:
    a model's ops must come in seq_id order; with `clock`, the cycle number reached (never moved
    back). Idempotent: an op no longer pending was committed already (False)."""
    models = await _models_before(redis, pairs)
    todo = list(range(len(pairs)))
    committed = [False] * len(pairs)
    while todo or clock is not None:
        async with redis.pipeline(transaction=False) as pipe:
            if clock is not None:
                pipe.eval(_ADVANCE_CLOCK, 1, keys.CLOCK, clock)
            for i in todo:
                op, outcome = pairs[i]
                args = _args(op, outcome, models.get(i, (b"", b"")), result_ttl_s)
                pipe.eval(COMMIT_OP, 12, *_keys(op, outcome), *args)
            replies = await pipe.execute()
        if clock is not None:
            replies, clock = replies[1:], None
        retry = [i for i, reply in zip(todo, replies, strict=True) if int(reply) < 0]
        for i, reply in zip(todo, replies, strict=True):
            committed[i] = int(reply) == 1
        if retry:  # a model record changed under us: read it again
            models = await _models_before(redis, [pairs[i] for i in retry], retry)
        todo = retry
    return committed


def _keys(op: QueuedOp, outcome: Outcome) -> list[str]:
    sampler = outcome.sampler
    return [
        keys.progress(op.model_id),
        keys.pending(op.model_id),
        keys.job(op.request_id),
        keys.replay(op.model_id),
        keys.model(op.model_id),
        keys.checkpoints(op.model_id),
        keys.inflight_target(op.model_id),
        keys.sampler(sampler.sampler_id if sampler else ""),
        keys.session_samplers(sampler.session_id if sampler else ""),
        keys.seq_claim(op.model_id, op.seq_id),
        keys.SAMPLER_USES,
        keys.history(op.model_id),
    ]


def _args(
    op: QueuedOp, outcome: Outcome, model: tuple[bytes, bytes], result_ttl_s: int
) -> list[bytes | str | int | float]:
    ckpt, target, sampler = outcome.checkpoint, outcome.inflight, outcome.sampler
    before, after = model
    args: list[bytes | str | int | float] = [
        op.request_id,
        op.seq_id,
        "" if outcome.snapshot_seq is None else outcome.snapshot_seq,
        time.time(),
        result_ttl_s,
        keys.job(""),
        "1" if outcome.replayed and outcome.error is None else "0",
        before,
        after,
        ckpt.checkpoint_id if ckpt else "",
        encoder.encode(ckpt) if ckpt else b"",
        target.version if target else "",
        encoder.encode(target) if target else b"",
        sampler.sampler_id if sampler else "",
        encoder.encode(sampler) if sampler else b"",
        keys.seq_claim_prefix(op.model_id),
        *_history(op, outcome),
    ]
    if op.kind != OpKind.REJECTED:  # a rejected op's error was written at submission
        args += ["status", JobStatus.DONE if outcome.error is None else JobStatus.FAILED]
        if outcome.result_bytes is not None:
            args += ["result", outcome.result_bytes]
        if outcome.error is not None:
            args += ["error", outcome.error, "category", outcome.category]
    return args


def _history(op: QueuedOp, outcome: Outcome) -> tuple[bytes, int, int]:
    """What a successful op adds to its run's history and counters: its metrics entry, the
    step an optim_step completes, a forward_backward's trained tokens."""
    if outcome.error is not None or outcome.metrics is None:
        return b"", 0, 0
    entry = HistoryEntry(
        op.seq_id, op.kind, time.time(), outcome.datums, op.tokens, outcome.metrics
    )
    step = 1 if op.kind == OpKind.OPTIM_STEP else 0
    trained = op.tokens if op.kind == OpKind.FORWARD_BACKWARD else 0
    return encoder.encode(entry), step, trained


async def _models_before(
    redis: Any, pairs: Sequence[tuple[QueuedOp, Outcome]], index: Sequence[int] | None = None
) -> dict[int, tuple[bytes, bytes]]:
    """For each op that registers a checkpoint: its model record as read now (or as the op
    before it in this batch leaves it) and as the op leaves it. One read for the batch."""
    at = range(len(pairs)) if index is None else index
    saves = [(i, op, o.checkpoint) for i, (op, o) in zip(at, pairs, strict=True) if o.checkpoint]
    if not saves:
        return {}
    ids = sorted({op.model_id for _, op, _ in saves})
    async with redis.pipeline(transaction=False) as pipe:
        for model_id in ids:
            pipe.get(keys.model(model_id))
        current: dict[str, bytes | None] = dict(zip(ids, await pipe.execute(), strict=True))
    out: dict[int, tuple[bytes, bytes]] = {}
    for i, op, ckpt in saves:
        raw = current[op.model_id]
        if raw is None:
            continue
        model = decode(raw, ModelRecord)
        if ckpt.checkpoint_type == CheckpointType.TRAINING:
            model.last_checkpoint = ckpt.checkpoint_id
        elif ckpt.checkpoint_type == CheckpointType.SAMPLER:
            model.last_sampler_checkpoint = ckpt.checkpoint_id
        out[i] = (raw, encoder.encode(model))
        current[op.model_id] = out[i][1]  # the next save of this model in the batch starts here
    return out


async def mark_snapshot(redis: Any, result_ttl_s: int, model_id: str, seq: int) -> int:
    """Record a snapshot finished in the background: `snapshot_seq` = max(recorded, seq)
    and the replay log trimmed up to it, in one script, unless the recorded progress has not
    reached `seq` (its step's commit failed). Returns the recorded mark (-1: none)."""
    mark = await redis.eval(
        MARK_SNAPSHOT,
        2,
        keys.progress(model_id),
        keys.replay(model_id),
        seq,
        keys.job(""),
        result_ttl_s,
        keys.seq_claim_prefix(model_id),
    )
    return int(mark)
