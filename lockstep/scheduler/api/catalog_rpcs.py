"""Catalog reads: sessions, models, samplers, training runs, checkpoints, capabilities, health.
Nothing here changes state except the sampler records a client creates or joins."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping

from lockstep.engine.capabilities import Engines, kernel_map
from lockstep.paths import TinkerPath
from lockstep.scheduler.admission.submissions import Submissions
from lockstep.scheduler.api import run_history
from lockstep.scheduler.api.servicer import Handler
from lockstep.scheduler.observers import tracing
from lockstep.scheduler.state import sample_futures
from lockstep.scheduler.state.catalog import Catalog, NotFound
from lockstep.scheduler.state.records import CheckpointRecord, ModelRecord, SamplerRecord
from lockstep.scheduler.state.runs import RunStats
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.version import STATE_FORMAT, VERSION
from lockstep.vocab import RunStatus

# A run's queued training requests listed by ListRunFutures (the rest are counted).
FUTURES_LISTED = 50


def checkpoint_pb(rec: CheckpointRecord) -> pb.Checkpoint:
    msg = pb.Checkpoint(
        checkpoint_id=rec.checkpoint_id,
        checkpoint_type=rec.checkpoint_type,
        time=rec.time,
        tinker_path=rec.tinker_path,
        size_bytes=rec.size_bytes,
        public=rec.public,
        user_metadata=rec.user_metadata,
    )
    if rec.expires_at is not None:
        msg.expires_at = rec.expires_at
    return msg


def lora_pb(model: ModelRecord) -> pb.LoraConfig:
    lc = pb.LoraConfig(
        rank=model.lora.rank,
        train_attn=model.lora.train_attn,
        train_mlp=model.lora.train_mlp,
        train_unembed=model.lora.train_unembed,
    )
    if model.lora.seed is not None:
        lc.seed = model.lora.seed
    return lc


def sampler_info(rec: SamplerRecord) -> pb.SamplerInfo:
    info = pb.SamplerInfo(sampler_id=rec.sampler_id, base_model=rec.base_model)
    if rec.model_path:
        info.model_path = rec.model_path
    return info


class CatalogRpcs:
    def __init__(
        self,
        store: Store,
        catalog: Catalog,
        submissions: Submissions,
        health: Callable[[], Awaitable[dict[str, str]]],
    ) -> None:
        self.store = store
        self.catalog = catalog
        self.submissions = submissions
        self.health = health

    def rpcs(self) -> Mapping[str, Handler]:
        return {
            "GetSession": self.get_session,
            "GetSessionTrace": self.get_session_trace,
            "ListSessions": self.list_sessions,
            "GetModelInfo": self.get_model_info,
            "CreateSamplingSession": self.create_sampling_session,
            "GetSampler": self.get_sampler,
            "JoinSamplingSession": self.join_sampling_session,
            "GetServerCapabilities": self.capabilities,
            "ListTrainingRuns": self.list_training_runs,
            "GetTrainingRun": self.get_training_run,
            "ListCheckpoints": self.list_checkpoints,
            "GetRunHistory": self.get_run_history,
            "ListRunFutures": self.list_run_futures,
            "GetWeightsInfo": self.get_weights_info,
            "Health": self.get_health,
        }

    # ---------------------------------------------------------------- sessions
    async def get_session(self, request: pb.SessionRef) -> pb.SessionInfo:
        rec = await self.catalog.owned_session(request.owner, request.session_id)
        models, samplers = await self.store.sessions.members(rec.session_id)
        info = pb.SessionInfo(
            training_run_ids=models, sampler_ids=samplers, user_metadata=rec.user_metadata
        )
        if rec.display_name is not None:
            info.display_name = rec.display_name
        return info

    async def get_session_trace(self, request: pb.SessionRef) -> pb.SessionTrace:
        rec = await self.catalog.owned_session(request.owner, request.session_id)  # else 404
        trace = await tracing.export(rec.session_id)
        return pb.SessionTrace(trace_json=json.dumps(trace).encode())

    async def list_sessions(self, request: pb.ListRequest) -> pb.SessionList:
        ids, total = await self.store.sessions.of_owner(
            request.owner, request.offset, request.limit or 20
        )
        return pb.SessionList(session_ids=ids, total_count=total)

    # ---------------------------------------------------------------- models and samplers
    async def get_model_info(self, request: pb.ModelRef) -> pb.ModelInfo:
        model = await self.catalog.owned_model(request.owner, request.model_id)
        card = self.catalog.card
        return pb.ModelInfo(
            model_id=model.model_id,
            base_model=model.base_model,
            arch=card.arch,
            tokenizer_id=card.directory,
            lora_rank=model.lora.rank,
            lora_config=lora_pb(model),
            max_tokens_per_datum=self.submissions.max_tokens_per_datum(),
            custom_loss_max_flops_per_token=self.submissions.custom_losses.bound.flops_per_token,
            custom_loss_max_memory_bytes=self.submissions.custom_losses.bound.memory_bytes,
            trainer_path=card.trainer_path.value,
            trainer_kernels=kernel_map(self.submissions.engines.trainer.kernels),
        )

    async def create_sampling_session(
        self, request: pb.CreateSamplingSessionRequest
    ) -> pb.SamplerInfo:
        rec = await self.catalog.create_sampler(
            request.owner,
            request.session_id,
            request.sampling_session_seq_id,
            request.model_path if request.HasField("model_path") else None,
            request.base_model if request.HasField("base_model") else None,
        )
        return sampler_info(rec)

    async def get_sampler(self, request: pb.SamplerRef) -> pb.SamplerInfo:
        return sampler_info(await self.catalog.owned_sampler(request.owner, request.sampler_id))

    async def join_sampling_session(self, request: pb.SamplerRef) -> pb.JoinSamplingSessionReply:
        sampler = await self.catalog.owned_sampler(request.owner, request.sampler_id)
        clone = await sample_futures.join(self.store, sampler.sampler_id)
        return pb.JoinSamplingSessionReply(client_counter=clone)

    async def capabilities(self, request: pb.CapabilitiesRequest) -> pb.ServerCapabilities:
        ctx = self.catalog.card.max_context_length
        per_datum = self.submissions.max_tokens_per_datum()
        budget = self.submissions.memory.budget_bytes
        loss = self.submissions.custom_losses.bound
        engines = self.submissions.engines
        return pb.ServerCapabilities(
            models=[
                pb.SupportedModel(
                    model_name=n,
                    max_context_length=ctx,
                    max_tokens_per_datum=per_datum,
                    trainer_memory_budget_bytes=budget,
                    custom_loss_max_flops_per_token=loss.flops_per_token,
                    custom_loss_max_memory_bytes=loss.memory_bytes,
                    trainer_path=self.catalog.card.trainer_path.value,
                    trainer_kernels=kernel_map(engines.trainer.kernels),
                    sampler_kernels=kernel_map(engines.sampler.kernels),
                )
                for n in self.catalog.served_names
            ],
            engines=engine_capabilities(engines),
            version=VERSION,
            state_format=STATE_FORMAT,
        )

    # ---------------------------------------------------------------- runs and checkpoints
    async def _run(self, model: ModelRecord) -> pb.TrainingRun:
        stats = await self.store.runs.stats(model.model_id, model.session_id)
        run = pb.TrainingRun(
            training_run_id=model.model_id,
            base_model=model.base_model,
            model_owner=model.owner,
            is_lora=True,
            last_request_time=stats.last_request_time or model.last_request_time,
            lora_rank=model.lora.rank,
            user_metadata=model.user_metadata,
            steps=stats.steps,
            tokens_trained=stats.tokens_trained,
            status=run_status(stats),
            queued=stats.queued,
        )
        for cid, slot in (
            (model.last_checkpoint, run.last_checkpoint),
            (model.last_sampler_checkpoint, run.last_sampler_checkpoint),
        ):
            rec = await self.store.checkpoints.get(model.model_id, cid) if cid else None
            if rec is not None:
                slot.CopyFrom(checkpoint_pb(rec))
        return run

    async def list_training_runs(self, request: pb.ListRequest) -> pb.TrainingRunList:
        limit = request.limit or 20
        if request.all_owners:
            models, total = await self.store.runs.every(request.offset, limit)
            return pb.TrainingRunList(runs=[await self._run(m) for m in models], total_count=total)
        ids, total = await self.store.runs.of_owner(request.owner, request.offset, limit)
        runs = [await self._run(await self.catalog.owned_model(request.owner, i)) for i in ids]
        return pb.TrainingRunList(runs=runs, total_count=total)

    async def _model(self, ref: pb.RunRef) -> ModelRecord:
        return await self.catalog.owned_model(ref.owner, ref.run_id, ref.all_owners)

    async def get_training_run(self, request: pb.RunRef) -> pb.TrainingRun:
        return await self._run(await self._model(request))

    async def get_run_history(self, request: pb.RunHistoryRequest) -> pb.RunHistory:
        model = await self._model(request.run)
        entries, steps = await self.store.runs.history(model.model_id)
        return run_history.steps_of(entries, steps, request.most_points)

    async def list_run_futures(self, request: pb.RunRef) -> pb.RunFutures:
        model = await self._model(request)
        queued, total = await self.store.runs.queued(model.model_id, FUTURES_LISTED)
        futures = [
            pb.QueuedFuture(
                request_id=rid,
                seq_id=seq,
                kind=(kind or b"").decode(),
                status=(status or b"").decode(),
            )
            for rid, seq, (kind, status) in queued
        ]
        return pb.RunFutures(futures=futures, total_count=total)

    async def list_checkpoints(self, request: pb.ListCheckpointsRequest) -> pb.CheckpointList:
        run_id = request.run_id if request.HasField("run_id") else None
        recs = await self.catalog.list_checkpoints(request.owner, run_id, request.all_owners)
        limit = request.limit or len(recs)
        page = recs[request.offset : request.offset + limit]
        return pb.CheckpointList(
            checkpoints=[checkpoint_pb(r) for r in page], total_count=len(recs)
        )

    async def get_weights_info(self, request: pb.CheckpointRef) -> pb.WeightsInfo:
        path = TinkerPath.parse(request.tinker_path, "tinker_path")
        await self.catalog.readable_checkpoint(request.owner, path, field="tinker_path")
        model = await self.store.runs.get(path.model_id)
        if model is None:
            raise NotFound(f"training run {path.model_id} does not exist")
        return pb.WeightsInfo(base_model=model.base_model, is_lora=True, lora_config=lora_pb(model))

    async def get_health(self, request: pb.Empty) -> pb.HealthReply:
        parts = await self.health()
        return pb.HealthReply(
            ready=all(v == "ready" for v in parts.values()),
            parts=parts,
            version=VERSION,
            state_format=STATE_FORMAT,
        )


def run_status(stats: RunStats) -> RunStatus:
    if stats.session_ended:
        return RunStatus.ENDED
    return RunStatus.TRAINING if stats.queued else RunStatus.IDLE


def engine_capabilities(engines: Engines) -> pb.EngineCapabilities:
    trainer, sampler = engines.trainer, engines.sampler
    return pb.EngineCapabilities(
        trainer=trainer.engine,
        losses=sorted(trainer.losses),
        custom_loss=trainer.custom_loss,
        trainer_inputs=sorted(trainer.inputs),
        optimizers=sorted(trainer.optimizers),
        sampler=sampler.engine,
        sampler_inputs=sorted(sampler.inputs),
    )
