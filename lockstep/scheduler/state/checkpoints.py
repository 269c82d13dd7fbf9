"""Checkpoint records (a hash per training run) and each run's inflight sampling target."""

from __future__ import annotations

from typing import Any

from lockstep.scheduler.state import commit, keys
from lockstep.scheduler.state.records import CheckpointRecord, InflightTarget, decode, encoder


class Checkpoints:
    def __init__(self, redis: Any) -> None:
        self.redis = redis

    async def put(self, model_id: str, rec: CheckpointRecord) -> None:
        await self.redis.hset(keys.checkpoints(model_id), rec.checkpoint_id, encoder.encode(rec))

    async def get(self, model_id: str, checkpoint_id: str) -> CheckpointRecord | None:
        raw = await self.redis.hget(keys.checkpoints(model_id), checkpoint_id)
        return None if raw is None else decode(raw, CheckpointRecord)

    async def of_run(self, model_id: str) -> list[CheckpointRecord]:
        """The run's checkpoints, oldest first."""
        raw = await self.redis.hgetall(keys.checkpoints(model_id))
        recs = [decode(v, CheckpointRecord) for v in raw.values()]
        return sorted(recs, key=lambda r: r.time)

    async def delete(self, model_id: str, checkpoint_id: str) -> bool:
        return bool(await self.redis.hdel(keys.checkpoints(model_id), checkpoint_id))

    async def advance_inflight(self, target: InflightTarget) -> bool:
        """Point the run's inflight target at `target` unless it already holds that version or
        a newer one (versions only move forward). Returns whether it moved."""
        moved = await self.redis.eval(
            commit.ADVANCE_INFLIGHT,
            1,
            keys.inflight_target(target.model_id),
            target.version,
            encoder.encode(target),
        )
        return bool(moved)

    async def inflight(self, model_id: str) -> InflightTarget | None:
        raw = await self.redis.get(keys.inflight_target(model_id))
        return None if raw is None else decode(raw, InflightTarget)
