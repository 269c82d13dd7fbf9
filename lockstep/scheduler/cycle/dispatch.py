"""Dispatch: execute one CyclePlan on the training engine.

Order inside a cycle: PRE ops (creations, loads, early saves) -> ONE fused pass over every
tenant's forward/forward_backward -> ONE batched optimizer step -> POST ops (saves). Each op
yields an Outcome; nothing is written to Redis here (that is `collect`). What an op does is its
own module's rule (`scheduler/ops/`): a single op runs itself (`SingleOp.run`, with this
Dispatcher as its RunContext); a pass or step op says how its share of the ONE engine call is
built and how its result is encoded, and the calls are batched here.

Durability: after a create or load a model's state is written to a snapshot directory before
the op is recorded; after an optim_step it is snapshotted in the background when its last
snapshot is `snapshot_interval_s` old (every step under paging), and recorded in Redis once
durable. An engine that restarted (a crash, a new scheduler) has no adapters; before a model's
next cycle its snapshot is loaded and the passes and steps since then (the replay log) are re-run,
so a crash loses nothing and applies nothing twice. If the engine dies during a cycle, the cycle
is abandoned before anything is written and runs again on a fresh engine.
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
from lockstep.engine.interface import EngineDied, TrainingEngine
from lockstep.engine.types import OptimRequest, PassRequest, PassResult
from lockstep.observability import metrics
from lockstep.scheduler.admission.decoded import DecodedPasses
from lockstep.scheduler.cycle.cadence import SnapshotCadence
from lockstep.scheduler.cycle.poison import PoisonHunt
from lockstep.scheduler.observers import tracing
from lockstep.scheduler.ops import registry
from lockstep.scheduler.ops.base import StepOp
from lockstep.scheduler.planner import CyclePlan
from lockstep.scheduler.state import storage
from lockstep.scheduler.state.jobs import Job
from lockstep.scheduler.state.outcome import Outcome, failure
from lockstep.scheduler.state.records import QueuedOp
from lockstep.scheduler.state.residency import Residency
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import ErrorCategory

log = logging.getLogger(__name__)
R = TypeVar("R")


class CycleAborted(RuntimeError):
    """The engine died mid-cycle: nothing of the cycle is recorded; it runs again."""


class Dispatcher:
    def __init__(
        self,
        store: Store,
        engine: TrainingEngine,
        data_dir: Path,
        max_resident: int = 0,
        snapshot_interval_s: float = DEFAULT_SNAPSHOT_INTERVAL_S,
        decoded: DecodedPasses | None = None,
    ) -> None:
        self.store = store
        # Passes validated and decoded at submission (run as they are); payloads of the rest,
        # read for the whole cycle in one round trip (`begin`).
        self.decoded = decoded or DecodedPasses()
        self._payloads: dict[str, bytes] = {}
        self.engine = engine
        self.data_dir = data_dir
        # Paging restores a model from its snapshot + replay log: keep page-ins cheap.
        self.cadence = SnapshotCadence(0.0 if max_resident else snapshot_interval_s)
        # Models whose state the engine holds right now, in LRU order; frees and pages them.
        self.resident = Residency(engine, max_resident, before_drop=self._snapshot_pending)
        # Which request kills the engine, when one does every time (bounded restarts).
        self.poison = PoisonHunt()

    # The Dispatcher is the RunContext its ops run in (scheduler/ops/base.py): `call`,
    # `durable_snapshot`, `ensure_resident`, and the store, engine, data dir and residency.
    async def call(self, fn: Callable[..., R], *args: object) -> R:
        with metrics.engine_call("trainer", fn.__name__):
            return await asyncio.to_thread(fn, *args)

    async def begin(self, plan: CyclePlan) -> int:
        """Number the cycle and read the payloads it needs (not decoded already): one round
        trip."""
        ops = [*plan.pre, *plan.passes, *plan.optims, *plan.post]
        unread = [op.request_id for op in ops if op.request_id not in self.decoded]
        cycle, self._payloads = await self.store.cycles.begin(unread)
        return cycle

    async def run(self, plan: CyclePlan, cycle: int) -> dict[str, Outcome]:
        """Execute the plan; one Outcome per op. A model whose state cannot be restored fails
        its own ops (with the reason) and the other tenants' work goes on."""
        try:
            await self.resident.make_room([w.model_id for w in plan.models])  # paging
            self.cadence.keep(self.resident)
            outcomes: dict[str, Outcome] = {}
            for work in plan.models:
                broken = await self._restore(work.model_id)
                if broken is not None:
                    outcomes.update((op.request_id, broken) for op in work.ops())

            def runnable(ops: list[QueuedOp]) -> list[QueuedOp]:
                return [op for op in ops if op.request_id not in outcomes]

            for op in runnable(plan.pre):
                with tracing.phase(op.kind, [op]):  # [trace hook]
                    outcomes[op.request_id] = await self._single(op)
            with tracing.phase("pass", plan.passes):  # [trace hook]
                outcomes.update(await self._passes(runnable(plan.passes), cycle))
            with tracing.phase("optimizer step", plan.optims):  # [trace hook]
                outcomes.update(await self._optims(runnable(plan.optims)))
            for op in runnable(plan.post):
                with tracing.phase(op.kind, [op]):  # [trace hook]
                    outcomes[op.request_id] = await self._single(op)
            return outcomes
        except EngineDied as exc:
            log.error("training engine died during cycle %d (%s); restarting it", cycle, exc)
            self.resident.clear()
            await asyncio.to_thread(self.engine.restart)
            raise CycleAborted(str(exc)) from exc

    async def _restore(self, model_id: str) -> Outcome | None:
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

    # ---------------------------------------------------------------- durability
    def snapshot_dir(self, model_id: str, seq: int) -> Path:
        return self.data_dir / "state" / model_id / f"seq-{seq}"

    async def _snapshot(self, model_id: str, seq: int) -> bool:
        """Snapshot the model's state after op `seq`; True if it is durable already (else the
        engine writes it in the background and `record_durable` records it later)."""
        self.cadence.taken(model_id)
        with tracing.model_phase("snapshot", model_id):  # [trace hook]
            return bool(
                await self.call(self.engine.snapshot, model_id, self.snapshot_dir(model_id, seq))
            )

    async def durable_snapshot(self, model_id: str, seq: int) -> None:
        """A snapshot that must be durable before its op is recorded (create, load: there is
        nothing earlier to replay from)."""
        try:
            with storage.atomic_dir(self.snapshot_dir(model_id, seq)) as tmp:  # complete or absent
                await self.call(self.engine.save_state, model_id, tmp, True)
            self.cadence.taken(model_id)
        except Exception:
            # The engine is now ahead of the recorded state: restore it before its next op.
            self.resident.discard(model_id)
            raise

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

    async def record_durable(self) -> None:
        """Snapshot the models whose pending steps are due (idle ones included), then record
        the background snapshots the engine finished (each trims its model's replay log) and
        drop the older snapshot files. Between cycles, so never on the critical path; a
        snapshot lost in flight simply is never recorded."""
        for model_id in self.cadence.lagging():
            await self._snapshot_pending(model_id)
        for model_id, directory in await self.call(self.engine.durable_snapshots):
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

    def prune_snapshots(self, model_id: str, keep_seq: int) -> None:
        """Snapshots of `model_id` older than seq-`keep_seq` (newer ones may still be being
        written in the background). Blocking: run it in a thread."""
        for old in (self.data_dir / "state" / model_id).glob("seq-*"):
            if int(old.name.removeprefix("seq-").removesuffix(".tmp")) < keep_seq:
                shutil.rmtree(old, ignore_errors=True)

    async def ensure_resident(self, model_id: str) -> None:
        if model_id in self.resident:
            return
        _, snapshot_seq = await self.store.cycles.progress(model_id)
        if snapshot_seq is None:
            return  # not created yet: its create/load is in this cycle
        started = time.monotonic()  # tenancy: page-in latency
        await self.call(
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
                    await self.call(self.engine.run_passes, passes)
                    passes = []
                await self.call(self.engine.optim_step, [rules.request(model_id, req)])
            else:
                rebuilt = registry.fused_pass(job.kind).decode(self.store, job.request_id, req)
                passes.append(await rebuilt)
        if passes:
            await self.call(self.engine.run_passes, passes)

    async def _request(self, op: QueuedOp) -> pb.SubmitRequest:
        payload = self._payloads.pop(op.request_id, None)
        if payload is None:  # not read with its cycle (a re-run after an abort)
            job = await self.store.jobs.get(op.request_id)
            if job is None:
                raise RuntimeError(f"job {op.request_id} vanished from the store")
            payload = job.payload
        req = pb.SubmitRequest()
        req.ParseFromString(payload)
        return req

    async def _pass(self, op: QueuedOp) -> PassRequest:
        """The pass as validated at submission, or decoded from its payload (its op's rule)."""
        held = self.decoded.take(op.request_id)
        if held is not None:
            return held
        return await registry.fused_pass(op.kind).decode(
            self.store, op.request_id, await self._request(op)
        )

    async def _single(self, op: QueuedOp) -> Outcome:
        """An op that runs alone (create, load, save): its op runs it."""
        try:
            rules = registry.single(op.kind)
            return await rules.run(self, op, await self._request(op))
        except Exception as exc:
            log.warning("request %s (%s) failed: %s", op.request_id, op.kind, exc)
            return failure(exc, f"{op.kind} of {op.model_id}")

    async def _passes(self, passes: list[QueuedOp], cycle: int) -> dict[str, Outcome]:
        outcomes: dict[str, Outcome] = {}
        requests: list[PassRequest] = []
        for op in passes:
            refused = self.poison.verdict(op.request_id)
            if refused is not None:  # it killed the engine on its own: never run again
                outcomes[op.request_id] = Outcome(error=refused, category=ErrorCategory.USER)
                continue
            try:
                requests.append(await self._pass(op))
            except Exception as exc:
                outcomes[op.request_id] = failure(exc)
        results: list[PassResult] = []
        for call in self.poison.calls([r.request_id for r in requests], requests):
            results.extend(await self._run_passes(call, outcomes))
        queued = {op.request_id: op for op in passes}
        for res in results:  # each result encoded by its op
            op = queued[res.request_id]
            outcomes[res.request_id] = registry.fused_pass(op.kind).outcome(op, res, cycle)
        return outcomes

    async def _run_passes(
        self, call: list[PassRequest], outcomes: dict[str, Outcome]
    ) -> list[PassResult]:
        """One run_passes call. A request the engine says failed alone (`PassResult.error`)
        fails with its error and the others keep their results. Only a failure the engine
        cannot attribute (the call raised: run_passes is then atomic, no gradient left behind)
        re-runs the call's requests one by one."""
        ids = [r.request_id for r in call]
        try:
            results = await self.call(self.engine.run_passes, call)
        except EngineDied as exc:  # the cycle is abandoned and runs again; keep score
            self.poison.died(ids, str(exc))
            raise
        except Exception as exc:
            if len(call) == 1:
                outcomes[call[0].request_id] = failure(exc)
                return []
            log.warning("fused pass failed (%s); retrying requests one by one", exc)
            return [res for r in call for res in await self._run_passes([r], outcomes)]
        self.poison.survived(ids)
        for res in results:
            if res.error is not None:
                outcomes[res.request_id] = Outcome(error=res.error, category=ErrorCategory.USER)
        return [res for res in results if res.error is None]

    async def _optims(self, steps: list[QueuedOp]) -> dict[str, Outcome]:
        if not steps:
            return {}
        outcomes: dict[str, Outcome] = {}
        requests: dict[str, OptimRequest] = {}
        for op in steps:  # each op says its share of the ONE batched step
            try:
                rules = registry.step(op.kind)
                requests[op.request_id] = rules.request(op.model_id, await self._request(op))
            except Exception as exc:
                outcomes[op.request_id] = failure(exc)
        try:
            metrics = await self.call(self.engine.optim_step, list(requests.values()))
        except Exception as exc:
            return outcomes | {rid: failure(exc) for rid in requests}
        queued = {op.request_id: op for op in steps}
        for rid, r in requests.items():
            durable = False
            try:
                if self.cadence.due(r.model_id):
                    durable = await self._snapshot(r.model_id, queued[rid].seq_id)
                else:  # the replay log holds it until a later snapshot does
                    self.cadence.skipped(r.model_id, queued[rid].seq_id)
            except Exception as exc:  # not recorded: the engine rolls back to the recorded state
                log.warning("optim_step %s: snapshot failed: %s", rid, exc)
                self.resident.discard(r.model_id)
                self.cadence.failed(r.model_id)
                outcomes[rid] = failure(exc, f"the optimizer step of {r.model_id}")
                continue
            # Not durable yet: the step stays in the replay log until its snapshot is recorded.
            snapshot_seq = queued[rid].seq_id if durable else None
            step = registry.step(queued[rid].kind)
            outcomes[rid] = step.outcome(metrics.get(r.model_id, {}), snapshot_seq)
        return outcomes
