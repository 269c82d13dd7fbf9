"""What the clock and the sampling lane read and write: every model's queue, a cycle's number
and payloads, the commit of its outcomes, each model's progress and replay log, and the
sampling lane's batch. Each read is one script or one pipeline: one round trip."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lockstep.scheduler.state import commit, keys
from lockstep.scheduler.state.jobs import Job, Jobs, job_from
from lockstep.scheduler.state.outcome import Outcome
from lockstep.scheduler.state.records import QueuedOp, SamplerRecord, decode
from lockstep.scheduler.state.scripts import FREES, READS
from lockstep.vocab import OpKind

# The sampling lane's batch: the queue's length, then {request id, job fields, sampler record}
# per queued sample (a sample job's model_id is its sampler). ARGV: limit, job and sampler key
# prefixes.
_SAMPLE_BATCH = (
    READS
    + """
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
)
# Every active model's queue in one read: {model id, next_seq, request id, seq, kind, tokens,
# ...} per model with queued requests. A model with an empty queue (or no record: it can never
# run) leaves the active set in the same atomic step, so a request claimed meanwhile (it re-adds
# the model) is never lost. ARGV: the model, pending, progress and job key prefixes.
_QUEUES = (
    FREES
    + """
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
)


class Cycles:
    def __init__(self, redis: Any, jobs: Jobs) -> None:
        self.redis = redis
        self.jobs = jobs
        self.result_ttl_s = jobs.result_ttl_s
        self._clock: int | None = None  # the last cycle number given (begin)

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
                    kind.decode() if kind else OpKind.REJECTED,
                    int(tokens),
                )
                for rid, seq, kind, tokens in zip(*[iter(row[2:])] * 4, strict=True)
            ]
        return queues, next_seq

    async def begin(self, request_ids: Sequence[str]) -> tuple[int, dict[str, bytes]]:
        """The new cycle's number and the payloads of its requests (not held decoded): at most
        one round trip, none when every payload is held. The clock numbers its cycles in
        process, from the number Redis keeps (read once), and each commit stores the number it
        reached (`commit`): a cycle that never commits (aborted, or its scheduler died) wrote
        nothing under its number, so a restart may give that number again."""
        if self._clock is None:
            self._clock = int(await self.redis.get(keys.CLOCK) or 0)
        self._clock += 1
        if not request_ids:
            return self._clock, {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid in request_ids:
                pipe.hget(keys.job(rid), "payload")
            payloads = await pipe.execute()
        found = zip(request_ids, payloads, strict=True)
        return self._clock, {rid: p for rid, p in found if p is not None}

    async def progress(self, model_id: str) -> tuple[int, int | None]:
        """(next_seq, snapshot_seq) of a model."""
        return commit.progress_of(
            await self.redis.hmget(keys.progress(model_id), ["next_seq", "snapshot_seq"])
        )

    async def commit(self, pairs: Sequence[tuple[QueuedOp, Outcome]]) -> list[bool]:
        """Record each op's outcome, each atomically (`commit.commit_ops`), all in one round
        trip, with the cycle number reached; a model's ops come in seq_id order. False: that op
        was committed already."""
        return await commit.commit_ops(self.redis, self.result_ttl_s, pairs, self._clock)

    async def commit_one(self, op: QueuedOp, outcome: Outcome) -> bool:
        """Record one op's outcome (see `commit`)."""
        return (await self.commit([(op, outcome)]))[0]

    async def mark_snapshot(self, model_id: str, seq: int) -> int:
        """Record a snapshot finished in the background (`commit.mark_snapshot`)."""
        return await commit.mark_snapshot(self.redis, self.result_ttl_s, model_id, seq)

    async def replay_log(self, model_id: str, after_seq: int) -> list[Job]:
        """The passes and steps to re-run, in seq order, on the snapshot taken at `after_seq`."""
        ids = await self.redis.zrangebyscore(keys.replay(model_id), f"({after_seq}", "+inf")
        return await self.jobs.get_many([i.decode() for i in ids])

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
            job = job_from(rid.decode(), {k.decode(): v for k, v in pairs})
            jobs.append(job)
            if sampler is not None:
                samplers[job.model_id] = decode(sampler, SamplerRecord)
        return int(backlog), jobs, samplers
