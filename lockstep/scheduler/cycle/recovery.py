"""Recovery: what makes the training engine's memory disposable. Snapshots (durable before a
create or load is recorded; after an optim_step at most once per `snapshot_interval_s`, in
the background, recorded once durable), restore (a model the engine does not hold is loaded
from its snapshot and its replay log re-run, before its next cycle) and the engine's resident
set (`Residency`: freeing and paging).

The Clock asks it, between cycles, for the resident set it plans with, the snapshots the engine
finished (`record_durable`) and the files it may drop (`prune`); the Dispatcher, within a
cycle, to make its models resident and to snapshot after a step. So a crash loses nothing and
applies nothing twice.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from lockstep.config.training import DEFAULT_SNAPSHOT_INTERVAL_S
from lockstep.engine.images import RUN_AGAIN, ImageReader
from lockstep.engine.interface import EngineDied, TrainingEngine
from lockstep.engine.types import PassRequest
from lockstep.observability import metrics
from lockstep.scheduler.cycle.cadence import SnapshotCadence
from lockstep.scheduler.observers import tracing
from lockstep.scheduler.ops import registry
from lockstep.scheduler.ops.base import StepOp
from lockstep.scheduler.planner import CyclePlan
from lockstep.scheduler.state import storage
from lockstep.scheduler.state.jobs import Job
from lockstep.scheduler.state.outcome import Outcome
from lockstep.scheduler.state.residency import Residency
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import ErrorCategory

log = logging.getLogger(__name__)
R = TypeVar("R")


async def trainer_call(fn: Callable[..., R], *args: object) -> R:
    """A training engine verb, off the event loop and metered."""
    with metrics.engine_call("trainer", fn.__name__):
        return await asyncio.to_thread(fn, *args)


class Recovery:
    def __init__(
        self,
        store: Store,
        engine: TrainingEngine,
        data_dir: Path,
        max_resident: int = 0,
        snapshot_interval_s: float = DEFAULT_SNAPSHOT_INTERVAL_S,
        images: ImageReader | None = None,
    ) -> None:
        self.store = store
        self.engine = engine
        # Payloads' images were judged at submission: a rerun reads their headers only.
        self.images = images or ImageReader(engine.card().vision, RUN_AGAIN, decode=False)
        self.data_dir = data_dir
        # Paging restores a model from its snapshot + replay log: keep page-ins cheap.
        self.cadence = SnapshotCadence(0.0 if max_resident else snapshot_interval_s)
        # Models whose state the engine holds right now, in LRU order; frees and pages them.
        self.resident = Residency(engine, max_resident, before_drop=self._snapshot_pending)

    # ---------------------------------------------------------------- within a cycle
    async def before_cycle(self, model_ids: list[str]) -> None:
        """Page out what the cycle's models need room for (outside the cycle's work)."""
        await self.resident.make_room(model_ids)  # paging
        self.cadence.keep(self.resident)

    async def restore(self, model_id: str) -> Outcome | None:
        """Make the model resident; on failure, the outcome its ops get (None: it is ready)."""
        try:
            await self.ensure_resident(model_id)
            return None
        except EngineDied:
            raise
        except Exception as exc:
            log.error("model %s could not be restored: %s", model_id, exc)
            return Outcome(
                error=f"model {model_id} could not be restored from its durable state "
                f"({type(exc).__name__}: {exc}); its requests fail until it is restored",
                category=ErrorCategory.SERVER,
            )

    async def ensure_resident(self, model_id: str) -> None:
        """Restore the model (snapshot + replay log) if the engine does not hold it."""
        if model_id in self.resident:
            return
        _, snapshot_seq = await self.store.cycles.progress(model_id)
        if snapshot_seq is None:
            return  # not created yet: its create/load is in this cycle
        started = time.monotonic()  # tenancy: page-in latency
        await trainer_call(
            self.engine.load_state, model_id, self.snapshot_dir(model_id, snapshot_seq), True
        )
        replay = await self.store.cycles.replay_log(model_id, snapshot_seq)
        await self._replay(model_id, replay)
        self.resident.paged_in(model_id, time.monotonic() - started)
        log.info(
            "restored %s from its snapshot at seq %d (+%d ops replayed)",
            model_id,
            snapshot_seq,
            len(replay),
        )

    async def _replay(self, model_id: str, jobs: list[Job]) -> None:
        """Re-run, in seq order, the passes and steps recorded since the snapshot (their outputs
        are discarded): consecutive passes as one run_passes call, each step as it came. How
        each is rebuilt from its payload is its op's rule."""
        passes: list[PassRequest] = []
        for job in jobs:
            req = pb.SubmitRequest.FromString(job.payload)
            rules = registry.queued_as(job.kind)
            if isinstance(rules, StepOp):
                if passes:
                    await trainer_call(self.engine.run_passes, passes)
                    passes = []
                await trainer_call(self.engine.optim_step, [rules.request(model_id, req)])
            else:
                rebuilt = registry.fused_pass(job.kind).decode(
                    self.store, self.images, job.request_id, req
                )
                passes.append(await rebuilt)
        if passes:
            await trainer_call(self.engine.run_passes, passes)

    async def durable_snapshot(self, model_id: str, seq: int) -> None:
        """A snapshot that must be durable before its op is recorded (create, load: there is
        nothing earlier to replay from)."""
        try:
            with storage.atomic_dir(self.snapshot_dir(model_id, seq)) as tmp:  # complete or absent
                await trainer_call(self.engine.save_state, model_id, tmp, True)
            self.cadence.taken(model_id)
        except Exception:
            # The engine is now ahead of the recorded state: restore it before its next op.
            self.resident.discard(model_id)
            raise

    async def after_step(self, model_id: str, seq: int) -> int | None:
        """After the model's optimizer step `seq`: snapshot it if its interval has passed.
        Returns `seq` if that state is durable already; None: the replay log holds the step
        until a snapshot is recorded. A failed snapshot raises, and the model is restored
        before its next op (the engine is ahead of the recorded state)."""
        try:
            if self.cadence.due(model_id):
                return seq if await self._snapshot(model_id, seq) else None
            self.cadence.skipped(model_id, seq)
            return None
        except Exception:
            self.resident.discard(model_id)
            self.cadence.failed(model_id)
            raise

    # ---------------------------------------------------------------- between cycles
    async def record_durable(self) -> None:
        """Snapshot the models whose pending steps are due (idle ones included), then record
        the background snapshots the engine finished (each trims its model's replay log) and
        drop the older snapshot files. Between cycles, so never on the critical path; a
        snapshot lost in flight simply is never recorded."""
        for model_id in self.cadence.lagging():
            await self._snapshot_pending(model_id)
        for model_id, directory in await trainer_call(self.engine.durable_snapshots):
            seq = int(directory.name.removeprefix("seq-"))
            kept = await self.store.cycles.mark_snapshot(model_id, seq)
            await asyncio.to_thread(self.prune_snapshots, model_id, kept)

    async def prune(self, plan: CyclePlan, outcomes: dict[str, Outcome]) -> None:
        """After commit: each model's snapshots other than the newest one Redis records go."""
        newest: dict[str, int] = {}
        for op in (op for work in plan.models for op in work.ops()):
            seq = outcomes[op.request_id].snapshot_seq if op.request_id in outcomes else None
            if seq is not None:
                newest[op.model_id] = max(seq, newest.get(op.model_id, seq))
        for model_id, seq in newest.items():
            await asyncio.to_thread(self.prune_snapshots, model_id, seq)

    # ---------------------------------------------------------------- snapshots
    def snapshot_dir(self, model_id: str, seq: int) -> Path:
        return self.data_dir / "state" / model_id / f"seq-{seq}"

    def prune_snapshots(self, model_id: str, keep_seq: int) -> None:
        """Snapshots of `model_id` older than seq-`keep_seq` (newer ones may still be being
        written in the background). Blocking: run it in a thread."""
        for old in (self.data_dir / "state" / model_id).glob("seq-*"):
            if int(old.name.removeprefix("seq-").removesuffix(".tmp")) < keep_seq:
                shutil.rmtree(old, ignore_errors=True)

    async def _snapshot(self, model_id: str, seq: int) -> bool:
        """Snapshot the model's state after op `seq`; True if it is durable already (else the
        engine writes it in the background and `record_durable` records it later)."""
        self.cadence.taken(model_id)
        with tracing.model_phase("snapshot", model_id):  # [trace hook]
            directory = self.snapshot_dir(model_id, seq)
            return bool(await trainer_call(self.engine.snapshot, model_id, directory))

    async def _snapshot_pending(self, model_id: str) -> None:
        """Snapshot the model's steps no snapshot holds yet (`cadence`), outside a cycle."""
        seq = self.cadence.pending(model_id)
        if seq is None:
            return
        try:
            durable = await self._snapshot(model_id, seq)
        except Exception as exc:  # its snapshot + replay log stand; its next step tries again
            log.warning("snapshot of %s at seq %d failed: %s", model_id, seq, exc)
            self.cadence.failed(model_id)
            return
        if durable:
            kept = await self.store.cycles.mark_snapshot(model_id, seq)
            await asyncio.to_thread(self.prune_snapshots, model_id, kept)
