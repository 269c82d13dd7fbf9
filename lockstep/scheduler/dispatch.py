"""Dispatch: execute one CyclePlan on the training engine.

Order inside a cycle: PRE ops (creations, loads, early saves) -> ONE fused pass over every
tenant's forward/forward_backward -> ONE batched optimizer step -> POST ops (saves). Each op
yields an Outcome; nothing is written to Redis here (that is `collect`).

Durability: after every op that changes a model's weights (create, load, optim_step) its state
is written to a snapshot directory, recorded in Redis with the op's outcome. An engine that
restarted (a crash, a new scheduler) has no adapters; before a model's next cycle its snapshot
is loaded and the forward_backward passes since then are re-run to rebuild its gradients, so a
crash loses nothing and applies nothing twice. If the engine dies during a cycle, the cycle is
abandoned before anything is written and runs again on a fresh engine.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from lockstep.engine.interface import TrainingEngine, UserInputError
from lockstep.engine.types import LoraSpec, OptimRequest, PassRequest
from lockstep.observability import metrics
from lockstep.scheduler import translate
from lockstep.scheduler.paths import TinkerPath, checkpoint_dir, ephemeral_dir
from lockstep.scheduler.planner import CyclePlan
from lockstep.scheduler.records import CheckpointRecord, QueuedOp, SamplerRecord
from lockstep.scheduler.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.workers.process import EngineDied

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    result: pb.JobResult | None = None
    error: str | None = None
    category: str = "user"
    checkpoint: CheckpointRecord | None = None  # a named checkpoint to register
    sampler: SamplerRecord | None = None  # an ephemeral sampler to register
    adapter_dir: Path | None = None  # new sampler weights to publish
    snapshot_seq: int | None = None  # the model's state after this op is its new snapshot


@dataclass
class DispatchResult:
    outcomes: dict[str, Outcome] = field(default_factory=dict)


def lora_spec(cfg: pb.LoraConfig) -> LoraSpec:
    return LoraSpec(
        rank=cfg.rank, alpha=32.0, seed=cfg.seed if cfg.HasField("seed") else None,
        train_attn=cfg.train_attn, train_mlp=cfg.train_mlp, train_unembed=cfg.train_unembed,
    )


class CycleAborted(RuntimeError):
    """The engine died mid-cycle: nothing of the cycle is recorded; it runs again."""


def failure(exc: BaseException) -> Outcome:
    if isinstance(exc, EngineDied):
        raise exc  # not the request's fault: abandon the cycle instead of failing it
    if isinstance(exc, UserInputError):
        return Outcome(error=str(exc), category="user")
    return Outcome(error=f"{type(exc).__name__}: {exc}", category="server")


class Dispatcher:
    def __init__(self, store: Store, engine: TrainingEngine, data_dir: Path) -> None:
        self.store = store
        self.engine = engine
        self.data_dir = data_dir
        self.resident: set[str] = set()  # models whose state the engine holds right now

    async def _call(self, fn, *args):  # type: ignore[no-untyped-def]
        with metrics.engine_call("trainer", fn.__name__):
            return await asyncio.to_thread(fn, *args)

    async def run(self, plan: CyclePlan, cycle: int) -> dict[str, Outcome]:
        try:
            for work in plan.models:
                await self._ensure_resident(work.model_id)
            outcomes: dict[str, Outcome] = {}
            for op in plan.pre:
                outcomes[op.request_id] = await self._single(op)
            outcomes.update(await self._passes(plan.passes, cycle))
            outcomes.update(await self._optims(plan.optims))
            for op in plan.post:
                outcomes[op.request_id] = await self._single(op)
            return outcomes
        except EngineDied as exc:
            log.error("training engine died during cycle %d (%s); restarting it", cycle, exc)
            self.resident.clear()
            restart = getattr(self.engine, "restart", None)
            if restart is None:
                raise
            await asyncio.to_thread(restart)
            raise CycleAborted(str(exc)) from exc

    # ---------------------------------------------------------------- durability
    def snapshot_dir(self, model_id: str, seq: int) -> Path:
        return self.data_dir / "state" / model_id / f"seq-{seq}"

    async def _snapshot(self, model_id: str, seq: int) -> None:
        final = self.snapshot_dir(model_id, seq)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        await self._call(self.engine.save_state, model_id, tmp, True)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # a snapshot directory is complete or absent

    def prune_snapshots(self, model_id: str, keep_seq: int) -> None:
        """Called once Redis records `keep_seq` as the snapshot: older ones are not needed."""
        for old in (self.data_dir / "state" / model_id).glob("seq-*"):
            if old.name != f"seq-{keep_seq}":
                shutil.rmtree(old, ignore_errors=True)

    async def _ensure_resident(self, model_id: str) -> None:
        if model_id in self.resident:
            return
        _, snapshot_seq = await self.store.progress(model_id)
        if snapshot_seq is None:
            return  # not created yet: its create/load is in this cycle
        await self._call(self.engine.load_state, model_id,
                         self.snapshot_dir(model_id, snapshot_seq), True)
        replay = await self.store.replay_log(model_id, snapshot_seq)
        if replay:
            requests = [translate.pass_request(
                job.request_id, pb.SubmitRequest.FromString(job.payload).forward_backward)
                for job in replay]
            await self._call(self.engine.run_passes, requests)
        self.resident.add(model_id)
        log.info("restored %s from its snapshot at seq %d (+%d passes replayed)", model_id,
                 snapshot_seq, len(replay))

    async def _request(self, op: QueuedOp) -> pb.SubmitRequest:
        job = await self.store.job(op.request_id)
        if job is None:
            raise RuntimeError(f"job {op.request_id} vanished from the store")
        return pb.SubmitRequest.FromString(job.payload)

    async def _single(self, op: QueuedOp) -> Outcome:
        try:
            req = await self._request(op)
            if op.kind == "create_model":
                c = req.create_model
                await self._call(self.engine.create_model, op.model_id, lora_spec(c.lora_config))
                self.resident.add(op.model_id)
                await self._snapshot(op.model_id, op.seq_id)
                return Outcome(pb.JobResult(create_model=pb.CreateModelResult(
                    model_id=op.model_id)), snapshot_seq=op.seq_id)
            if op.kind == "load":
                return await self._load(op, req.load_weights)
            if op.kind == "save":
                return await self._save(op, req.owner, req.save_weights)
            raise RuntimeError(f"unexpected op kind {op.kind}")
        except Exception as exc:
            log.warning("request %s (%s) failed: %s", op.request_id, op.kind, exc)
            return failure(exc)

    async def _load(self, op: QueuedOp, load: pb.LoadWeights) -> Outcome:
        path = TinkerPath.parse(load.path)
        directory = checkpoint_dir(self.data_dir, path)
        if not directory.is_dir():
            raise UserInputError("path", f"checkpoint {load.path} has no files on this server")
        await self._call(self.engine.load_state, op.model_id, directory, load.optimizer)
        self.resident.add(op.model_id)
        await self._snapshot(op.model_id, op.seq_id)
        return Outcome(pb.JobResult(load=pb.LoadResult(model_id=op.model_id, path=load.path)),
                       snapshot_seq=op.seq_id)

    async def _save(self, op: QueuedOp, owner: str, save: pb.SaveWeights) -> Outcome:
        model = await self.store.model(op.model_id)
        if model is None:
            raise RuntimeError(f"model {op.model_id} has no record")
        now = time.time()
        if not save.HasField("name"):  # ephemeral sampler weights -> a new sampling session
            sampler_id = f"{model.session_id}:sample:{save.sampling_session_seq_id}"
            directory = ephemeral_dir(self.data_dir, op.model_id, sampler_id)
            size = await self._call(self.engine.export_adapter, op.model_id, directory)
            sampler = SamplerRecord(sampler_id=sampler_id, owner=owner,
                                    session_id=model.session_id, base_model=model.base_model,
                                    adapter_dir=str(directory), adapter_id=sampler_id,
                                    created=now)
            result = pb.SaveResult(sampling_session_id=sampler_id, size_bytes=size)
            return Outcome(pb.JobResult(save=result), sampler=sampler, adapter_dir=directory)
        segment = {pb.CHECKPOINT_KIND_TRAINING: "weights",
                   pb.CHECKPOINT_KIND_SAMPLER: "sampler_weights",
                   pb.CHECKPOINT_KIND_EXTERNAL: "external_weights"}[save.kind]
        path = TinkerPath(op.model_id, segment, save.name)
        existing = await self.store.checkpoint(op.model_id, path.checkpoint_id)
        if existing is not None and not save.overwrite:
            raise UserInputError("path", f"checkpoint {path} already exists (pass overwrite)")
        directory = checkpoint_dir(self.data_dir, path)
        if save.kind == pb.CHECKPOINT_KIND_TRAINING:
            size = await self._call(self.engine.save_state, op.model_id, directory, True)
        else:
            size = await self._call(self.engine.export_adapter, op.model_id, directory)
        record = CheckpointRecord(
            checkpoint_id=path.checkpoint_id, checkpoint_type=path.checkpoint_type,
            tinker_path=str(path), directory=str(directory), time=now, size_bytes=size,
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
            try:
                req = await self._request(op)
                requests.append(translate.pass_request(op.request_id, req.forward_backward))
            except Exception as exc:
                outcomes[op.request_id] = failure(exc)
        if not requests:
            return outcomes
        try:
            results = await self._call(self.engine.run_passes, requests)
        except Exception as exc:
            if len(requests) == 1:
                outcomes[requests[0].request_id] = failure(exc)
                return outcomes
            # One bad request must not fail its neighbours: isolate it by running them alone.
            log.warning("fused pass failed (%s); retrying requests one by one", exc)
            results = []
            for r in requests:
                try:
                    results.extend(await self._call(self.engine.run_passes, [r]))
                except Exception as single:
                    outcomes[r.request_id] = failure(single)
        for res in results:
            output = translate.pass_output(res, cycle)
            outcomes[res.request_id] = Outcome(pb.JobResult(forward_backward=output))
        return outcomes

    async def _optims(self, ops: list[QueuedOp]) -> dict[str, Outcome]:
        if not ops:
            return {}
        outcomes: dict[str, Outcome] = {}
        requests: dict[str, OptimRequest] = {}
        for op in ops:
            try:
                req = await self._request(op)
                requests[op.request_id] = OptimRequest(
                    op.model_id, translate.adam_config(req.optim_step.adam))
            except Exception as exc:
                outcomes[op.request_id] = failure(exc)
        try:
            metrics = await self._call(self.engine.optim_step, list(requests.values()))
        except Exception as exc:
            return outcomes | {rid: failure(exc) for rid in requests}
        seq_of = {op.request_id: op.seq_id for op in ops}
        for rid, r in requests.items():
            await self._snapshot(r.model_id, seq_of[rid])
            result = pb.OptimStepResult(metrics=metrics.get(r.model_id, {}))
            outcomes[rid] = Outcome(pb.JobResult(optim_step=result), snapshot_seq=seq_of[rid])
        return outcomes
