"""Dispatch: execute one CyclePlan on the training engine.

Order inside a cycle: PRE ops (creations, loads, early saves) -> ONE fused pass over every
tenant's forward/forward_backward -> ONE batched optimizer step -> POST ops (saves). Each op
yields an Outcome; nothing is written to Redis here (that is `collect`).

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
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from lockstep.config.sections import DEFAULT_SNAPSHOT_INTERVAL_S
from lockstep.engine.interface import EngineDied, TrainingEngine
from lockstep.engine.types import LoraSpec, OptimRequest, PassRequest, PassResult
from lockstep.errors import UserInputError
from lockstep.observability import metrics
from lockstep.paths import TinkerPath, checkpoint_dir, ephemeral_dir
from lockstep.scheduler import custom_losses, encryption, storage, tracing, translate
from lockstep.scheduler.cadence import SnapshotCadence
from lockstep.scheduler.decoded import DecodedPasses
from lockstep.scheduler.outcome import Outcome, failure
from lockstep.scheduler.planner import CyclePlan
from lockstep.scheduler.poison import PoisonHunt
from lockstep.scheduler.records import (
    CheckpointRecord,
    InflightTarget,
    QueuedOp,
    SamplerRecord,
)
from lockstep.scheduler.residency import Residency
from lockstep.scheduler.store import Job, Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import ErrorCategory, OpKind

log = logging.getLogger(__name__)
R = TypeVar("R")


def lora_spec(cfg: pb.LoraConfig) -> LoraSpec:
    return LoraSpec(
        rank=cfg.rank,
        alpha=32.0,
        seed=cfg.seed if cfg.HasField("seed") else None,
        train_attn=cfg.train_attn,
        train_mlp=cfg.train_mlp,
        train_unembed=cfg.train_unembed,
    )


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
        # Ops that run alone (not fused), by kind: PRE and POST phases of a cycle.
        self._handlers: dict[OpKind, Callable[[QueuedOp, pb.SubmitRequest], Awaitable[Outcome]]]
        self._handlers = {
            OpKind.CREATE_MODEL: self._create,
            OpKind.LOAD: lambda op, req: self._load(op, req.load_weights),
            OpKind.SAVE: lambda op, req: self._save(op, req.owner, req.save_weights),
        }

    async def _call(self, fn: Callable[..., R], *args: object) -> R:
        with metrics.engine_call("trainer", fn.__name__):
            return await asyncio.to_thread(fn, *args)

    async def begin(self, plan: CyclePlan) -> int:
        """Number the cycle and read the payloads it needs (not decoded already): one round
        trip."""
        ops = [*plan.pre, *plan.passes, *plan.optims, *plan.post]
        unread = [op.request_id for op in ops if op.request_id not in self.decoded]
        cycle, self._payloads = await self.store.begin_cycle(unread)
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
            await self._ensure_resident(model_id)
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
                await self._call(self.engine.snapshot, model_id, self.snapshot_dir(model_id, seq))
            )

    async def _durable_snapshot(self, model_id: str, seq: int) -> None:
        """A snapshot that must be durable before its op is recorded (create, load: there is
        nothing earlier to replay from)."""
        try:
            with storage.atomic_dir(self.snapshot_dir(model_id, seq)) as tmp:  # complete or absent
                await self._call(self.engine.save_state, model_id, tmp, True)
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
            kept = await self.store.mark_snapshot(model_id, seq)
            await asyncio.to_thread(self.prune_snapshots, model_id, kept)

    async def record_durable(self) -> None:
        """Snapshot the models whose pending steps are due (idle ones included), then record
        the background snapshots the engine finished (each trims its model's replay log) and
        drop the older snapshot files. Between cycles, so never on the critical path; a
        snapshot lost in flight simply is never recorded."""
        for model_id in self.cadence.lagging():
            await self._snapshot_pending(model_id)
        for model_id, directory in await self._call(self.engine.durable_snapshots):
            seq = int(directory.name.removeprefix("seq-"))
            kept = await self.store.mark_snapshot(model_id, seq)
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

    async def _ensure_resident(self, model_id: str) -> None:
        if model_id in self.resident:
            return
        _, snapshot_seq = await self.store.progress(model_id)
        if snapshot_seq is None:
            return  # not created yet: its create/load is in this cycle
        started = time.monotonic()  # tenancy: page-in latency
        await self._call(
            self.engine.load_state, model_id, self.snapshot_dir(model_id, snapshot_seq), True
        )
        replay = await self.store.replay_log(model_id, snapshot_seq)
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
        are discarded): consecutive passes as one run_passes call, each step as it came."""
        passes: list[PassRequest] = []
        for job in jobs:
            req = pb.SubmitRequest.FromString(job.payload)
            if job.kind == OpKind.OPTIM_STEP:
                if passes:
                    await self._call(self.engine.run_passes, passes)
                    passes = []
                adam = translate.adam_config(req.optim_step.adam)
                await self._call(self.engine.optim_step, [OptimRequest(model_id, adam)])
            else:
                passes.append(translate.pass_request(job.request_id, req.forward_backward))
                await custom_losses.attach(self.store, passes[-1])
        if passes:
            await self._call(self.engine.run_passes, passes)

    async def _request(self, op: QueuedOp) -> pb.SubmitRequest:
        payload = self._payloads.pop(op.request_id, None)
        if payload is None:  # not read with its cycle (a re-run after an abort)
            job = await self.store.job(op.request_id)
            if job is None:
                raise RuntimeError(f"job {op.request_id} vanished from the store")
            payload = job.payload
        req = pb.SubmitRequest()
        req.ParseFromString(payload)
        return req

    async def _pass(self, op: QueuedOp) -> PassRequest:
        """The pass as validated at submission, or decoded from its payload."""
        held = self.decoded.take(op.request_id)
        if held is not None:
            return held
        pass_req = translate.pass_request(op.request_id, (await self._request(op)).forward_backward)
        await custom_losses.attach(self.store, pass_req)
        return pass_req

    async def _single(self, op: QueuedOp) -> Outcome:
        """An op that runs alone (create, load, save), through its handler."""
        try:
            handler = self._handlers.get(op.kind)
            if handler is None:
                raise RuntimeError(f"unexpected op kind {op.kind}")
            return await handler(op, await self._request(op))
        except Exception as exc:
            log.warning("request %s (%s) failed: %s", op.request_id, op.kind, exc)
            return failure(exc, f"{op.kind} of {op.model_id}")

    async def _create(self, op: QueuedOp, req: pb.SubmitRequest) -> Outcome:
        spec = lora_spec(req.create_model.lora_config)
        await self._call(self.engine.create_model, op.model_id, spec)
        self.resident.add(op.model_id)
        await self._durable_snapshot(op.model_id, op.seq_id)
        result = pb.CreateModelResult(model_id=op.model_id)
        return Outcome(pb.JobResult(create_model=result), snapshot_seq=op.seq_id)

    async def _load(self, op: QueuedOp, load: pb.LoadWeights) -> Outcome:
        path = TinkerPath.parse(load.path)
        directory = checkpoint_dir(self.data_dir, path)
        if not directory.is_dir():
            raise UserInputError("path", f"checkpoint {load.path} has no files on this server")
        await self._call(self.engine.load_state, op.model_id, directory, load.optimizer)
        self.resident.add(op.model_id)
        await self._durable_snapshot(op.model_id, op.seq_id)
        return Outcome(
            pb.JobResult(load=pb.LoadResult(model_id=op.model_id, path=load.path)),
            snapshot_seq=op.seq_id,
        )

    async def _save(self, op: QueuedOp, owner: str, save: pb.SaveWeights) -> Outcome:
        model = await self.store.model(op.model_id)
        if model is None:
            raise RuntimeError(f"model {op.model_id} has no record")
        await self._ensure_resident(op.model_id)  # after a failed snapshot earlier this cycle
        now = time.time()
        if not save.HasField("name"):  # ephemeral sampler weights -> a new sampling session
            sampler_id = f"{model.session_id}:sample:{save.sampling_session_seq_id}"
            directory = ephemeral_dir(self.data_dir, op.model_id, sampler_id)
            with storage.atomic_dir(directory) as tmp:
                size = await self._call(self.engine.export_adapter, op.model_id, tmp)
            inflight = save.sampler_kind == pb.SAMPLER_KIND_INFLIGHT
            sampler = SamplerRecord(
                sampler_id=sampler_id,
                owner=owner,
                session_id=model.session_id,
                base_model=model.base_model,
                adapter_dir=str(directory),
                adapter_id=sampler_id,
                created=now,
                inflight_model=op.model_id if inflight else None,
                min_version=op.seq_id if inflight else 0,
            )
            # An inflight save also becomes the model's shared target, versioned by its seq_id.
            target = (
                InflightTarget(op.model_id, op.seq_id, sampler_id, str(directory), now)
                if inflight
                else None
            )
            result = pb.SaveResult(sampling_session_id=sampler_id, size_bytes=size)
            return Outcome(
                pb.JobResult(save=result), sampler=sampler, adapter_dir=directory, inflight=target
            )
        segment = {
            pb.CHECKPOINT_KIND_TRAINING: "weights",
            pb.CHECKPOINT_KIND_SAMPLER: "sampler_weights",
            pb.CHECKPOINT_KIND_EXTERNAL: "external_weights",
        }[save.kind]
        path = TinkerPath(op.model_id, segment, save.name)
        existing = await self.store.checkpoint(op.model_id, path.checkpoint_id)
        if existing is not None and not save.overwrite:
            raise UserInputError("path", f"checkpoint {path} already exists (pass overwrite)")
        directory = checkpoint_dir(self.data_dir, path)
        with storage.atomic_dir(directory) as tmp:
            if save.kind == pb.CHECKPOINT_KIND_TRAINING:
                size = await self._call(self.engine.save_state, op.model_id, tmp, True)
            else:
                size = await self._call(self.engine.export_adapter, op.model_id, tmp)
            if save.age_recipients:  # encrypted before it is renamed in: no plaintext checkpoint
                recipients = encryption.parse_recipients(list(save.age_recipients))
                size = await asyncio.to_thread(encryption.encrypt_tree, tmp, recipients)
        record = CheckpointRecord(
            checkpoint_id=path.checkpoint_id,
            checkpoint_type=path.checkpoint_type,
            tinker_path=str(path),
            directory=str(directory),
            time=now,
            size_bytes=size,
            expires_at=now + save.ttl_seconds if save.HasField("ttl_seconds") else None,
            user_metadata=dict(save.user_metadata),
        )
        result = pb.SaveResult(path=str(path), size_bytes=size)
        publish = directory if save.kind == pb.CHECKPOINT_KIND_SAMPLER else None
        return Outcome(pb.JobResult(save=result), checkpoint=record, adapter_dir=publish)

    async def _passes(self, ops: list[QueuedOp], cycle: int) -> dict[str, Outcome]:
        outcomes: dict[str, Outcome] = {}
        requests: list[PassRequest] = []
        for op in ops:
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
        for res in results:
            output = translate.pass_output(res, cycle)
            outcomes[res.request_id] = Outcome(pb.JobResult(forward_backward=output))
        return outcomes

    async def _run_passes(
        self, call: list[PassRequest], outcomes: dict[str, Outcome]
    ) -> list[PassResult]:
        """One run_passes call; a request that fails it fails alone (run_passes is atomic: the
        failed call left no gradient behind, so its requests re-run one by one)."""
        ids = [r.request_id for r in call]
        try:
            results = await self._call(self.engine.run_passes, call)
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
        return list(results)

    async def _optims(self, ops: list[QueuedOp]) -> dict[str, Outcome]:
        if not ops:
            return {}
        outcomes: dict[str, Outcome] = {}
        requests: dict[str, OptimRequest] = {}
        for op in ops:
            try:
                req = await self._request(op)
                requests[op.request_id] = OptimRequest(
                    op.model_id, translate.adam_config(req.optim_step.adam)
                )
            except Exception as exc:
                outcomes[op.request_id] = failure(exc)
        try:
            metrics = await self._call(self.engine.optim_step, list(requests.values()))
        except Exception as exc:
            return outcomes | {rid: failure(exc) for rid in requests}
        seq_of = {op.request_id: op.seq_id for op in ops}
        for rid, r in requests.items():
            durable = False
            try:
                if self.cadence.due(r.model_id):
                    durable = await self._snapshot(r.model_id, seq_of[rid])
                else:  # the replay log holds it until a later snapshot does
                    self.cadence.skipped(r.model_id, seq_of[rid])
            except Exception as exc:  # not recorded: the engine rolls back to the recorded state
                log.warning("optim_step %s: snapshot failed: %s", rid, exc)
                self.resident.discard(r.model_id)
                self.cadence.failed(r.model_id)
                outcomes[rid] = failure(exc, f"the optimizer step of {r.model_id}")
                continue
            result = pb.OptimStepResult(metrics=metrics.get(r.model_id, {}))
            # Not durable yet: the step stays in the replay log until its snapshot is recorded.
            outcomes[rid] = Outcome(
                pb.JobResult(optim_step=result), snapshot_seq=seq_of[rid] if durable else None
            )
        return outcomes
