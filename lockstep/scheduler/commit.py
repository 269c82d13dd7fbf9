"""One transaction per op: how a cycle's outcomes reach Redis (`Store.commit` delegates here).

Each op's result or error, the checkpoint / sampler / inflight records it made, its model record,
the model's progress and its replay log are written in ONE WATCH/MULTI transaction, so a crash
leaves all of it or none of it. Progress only moves forward, enforced here and not only by the
order of commits: `next_seq` = max(recorded, seq_id + 1), `snapshot_seq` likewise.
"""

from __future__ import annotations

import time
from typing import Any

from redis.exceptions import WatchError

from lockstep.scheduler import keys
from lockstep.scheduler.outcome import Outcome
from lockstep.scheduler.records import ModelRecord, QueuedOp, decode, encoder
from lockstep.vocab import CheckpointType, JobStatus, OpKind

# Ops whose effect a snapshot does not yet hold are re-run from the replay log on a restore.
REPLAYED = frozenset({OpKind.FORWARD_BACKWARD, OpKind.OPTIM_STEP})
# The inflight weights target of a model only moves to a newer version (compare-and-set).
ADVANCE_INFLIGHT = """
local current = redis.call('GET', KEYS[1])
if current and cjson.decode(current)['version'] >= tonumber(ARGV[1]) then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""


def progress_of(raw: list[bytes | None]) -> tuple[int, int | None]:
    """(next_seq, snapshot_seq) from an HMGET of a progress hash."""
    return int(raw[0] or 0), None if raw[1] is None else int(raw[1])


async def commit_op(redis: Any, result_ttl_s: int, op: QueuedOp, outcome: Outcome) -> bool:
    """Record one training op's outcome in ONE transaction: the job's result or error, the
    checkpoint / sampler records it made, its model record, the model's progress and replay
    log. A crash leaves either all of it or none of it (then the op runs again).

    Progress only moves forward: `next_seq` becomes max(recorded, seq_id + 1) and
    `snapshot_seq` max(recorded, new), so an op committed late can never move a model back.
    Idempotent: an op no longer pending was committed already (returns False).
    A successful forward_backward keeps its payload and joins the model's replay log until a
    snapshot covers it; a new `snapshot_seq` empties the log up to it.
    """
    watched = (keys.progress(op.model_id), keys.pending(op.model_id), keys.model(op.model_id))
    async with redis.pipeline(transaction=True) as pipe:
        while True:
            try:
                await pipe.watch(*watched)
                if await pipe.zscore(keys.pending(op.model_id), op.request_id) is None:
                    return False
                next_seq, snapshot_seq = progress_of(
                    await pipe.hmget(keys.progress(op.model_id), ["next_seq", "snapshot_seq"])
                )
                model = await _model_after(pipe, op.model_id, outcome)
                new_snapshot = outcome.snapshot_seq
                if new_snapshot is not None and snapshot_seq is not None:
                    new_snapshot = max(new_snapshot, snapshot_seq)
                stale: list[str] = []
                if new_snapshot is not None:
                    stale = [
                        r.decode()
                        for r in await pipe.zrangebyscore(
                            keys.replay(op.model_id), "-inf", new_snapshot
                        )
                    ]
                pipe.multi()
                _write_outcome(pipe, op, outcome, model, result_ttl_s)
                progress: dict[str, float | int] = {
                    "next_seq": max(next_seq, op.seq_id + 1),
                    "last_request_time": time.time(),
                }
                if new_snapshot is not None:
                    progress["snapshot_seq"] = new_snapshot
                pipe.hset(keys.progress(op.model_id), mapping=progress)
                _trim_replay(pipe, op.model_id, stale, result_ttl_s)
                await pipe.execute()
                return True
            except WatchError:
                continue


async def _model_after(pipe: Any, model_id: str, outcome: Outcome) -> ModelRecord | None:
    """The model record as `outcome` leaves it (None: unchanged). Read under the WATCH."""
    ckpt = outcome.checkpoint
    if ckpt is None:
        return None
    raw = await pipe.get(keys.model(model_id))
    if raw is None:
        return None
    model = decode(raw, ModelRecord)
    if ckpt.checkpoint_type == CheckpointType.TRAINING:
        model.last_checkpoint = ckpt.checkpoint_id
    elif ckpt.checkpoint_type == CheckpointType.SAMPLER:
        model.last_sampler_checkpoint = ckpt.checkpoint_id
    return model


def _write_outcome(
    pipe: Any, op: QueuedOp, outcome: Outcome, model: ModelRecord | None, result_ttl_s: int
) -> None:
    """Queue (inside MULTI) the job's fields, its records, and its place in the replay log."""
    job = keys.job(op.request_id)
    if outcome.checkpoint is not None:
        rec = outcome.checkpoint
        pipe.hset(keys.checkpoints(op.model_id), rec.checkpoint_id, encoder.encode(rec))
    if model is not None:
        pipe.set(keys.model(op.model_id), encoder.encode(model))
    if outcome.inflight is not None:  # versions only move forward (compare-and-set)
        t = outcome.inflight
        pipe.eval(
            ADVANCE_INFLIGHT, 1, keys.inflight_target(t.model_id), t.version, encoder.encode(t)
        )
    if outcome.sampler is not None:
        pipe.set(keys.sampler(outcome.sampler.sampler_id), encoder.encode(outcome.sampler))
        pipe.sadd(keys.session_samplers(outcome.sampler.session_id), outcome.sampler.sampler_id)
    if op.kind != OpKind.REJECTED:  # a rejected op's error was written at submission
        fields: dict[str, bytes | str] = {
            "status": JobStatus.DONE if outcome.error is None else JobStatus.FAILED
        }
        if outcome.result is not None:
            fields["result"] = outcome.result.SerializeToString()
        if outcome.error is not None:
            fields["error"] = outcome.error
            fields["category"] = outcome.category
        pipe.hset(job, mapping=fields)
    pipe.zrem(keys.pending(op.model_id), op.request_id)
    covered = outcome.snapshot_seq is not None and op.seq_id <= outcome.snapshot_seq
    if op.kind in REPLAYED and outcome.error is None and not covered:
        # A replay-log entry keeps its payload until a snapshot covers it.
        pipe.zadd(keys.replay(op.model_id), {op.request_id: op.seq_id})
    else:
        pipe.hdel(job, "payload")
        pipe.expire(job, result_ttl_s)


async def mark_snapshot(redis: Any, result_ttl_s: int, model_id: str, seq: int) -> int:
    """Record a snapshot finished in the background: `snapshot_seq` = max(recorded, seq)
    and the replay log trimmed up to it, in one transaction. Returns the recorded mark."""
    async with redis.pipeline(transaction=True) as pipe:
        while True:
            try:
                await pipe.watch(keys.progress(model_id))
                _, current = progress_of(
                    await pipe.hmget(keys.progress(model_id), ["next_seq", "snapshot_seq"])
                )
                mark = seq if current is None else max(seq, current)
                stale = [
                    r.decode()
                    for r in await pipe.zrangebyscore(keys.replay(model_id), "-inf", mark)
                ]
                pipe.multi()
                pipe.hset(keys.progress(model_id), "snapshot_seq", mark)
                _trim_replay(pipe, model_id, stale, result_ttl_s)
                await pipe.execute()
                return mark
            except WatchError:
                continue


def _trim_replay(pipe: Any, model_id: str, stale: list[str], result_ttl_s: int) -> None:
    if not stale:
        return
    pipe.zrem(keys.replay(model_id), *stale)
    for rid in stale:
        pipe.hdel(keys.job(rid), "payload")
        pipe.expire(keys.job(rid), result_ttl_s)
