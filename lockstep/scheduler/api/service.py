"""The scheduler's gRPC service: thin methods over Submissions, Catalog and the futures board."""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from lockstep.errors import UserInputError
from lockstep.observability import metrics
from lockstep.paths import TinkerPath
from lockstep.scheduler.admission.submissions import Submissions
from lockstep.scheduler.observers import tracing
from lockstep.scheduler.state import redis_conn, sample_futures
from lockstep.scheduler.state.catalog import Catalog, NotFound, OverCapacity
from lockstep.scheduler.state.futures import FutureBoard
from lockstep.scheduler.state.records import CheckpointRecord, ModelRecord, SamplerRecord
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.v1 import scheduler_pb2_grpc as pb_grpc
from lockstep.vocab import JobStatus, OpKind

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

# The gateway's long-poll must answer before the SDK's 45 s read timeout.
MAX_POLL_SECONDS = 30.0


def grpc_errors(fn: F) -> F:
    """Map domain errors to gRPC status codes (the gateway maps those to HTTP); time the
    handler and label its Redis round trips with the method."""
    method, caller = fn.__name__, f"rpc:{fn.__name__}"

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        token = metrics.REDIS_CALLER.set(caller)
        start = time.perf_counter()
        try:
            return await fn(self, request, context)
        except UserInputError as exc:
            metrics.refused("INVALID_ARGUMENT")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NotFound as exc:
            metrics.refused("NOT_FOUND")
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except OverCapacity as exc:
            metrics.refused("RESOURCE_EXHAUSTED")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except redis_conn.UNAVAILABLE_ERRORS as exc:  # still down after the client's retries
            log.warning("%s: redis unavailable: %s", fn.__name__, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "state store unavailable, retry")
        finally:
            metrics.RPC_SECONDS.labels(method).observe(time.perf_counter() - start)
            metrics.REDIS_CALLER.reset(token)

    return wrapper  # type: ignore[return-value]


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


class SchedulerService(pb_grpc.SchedulerServicer):
    def __init__(
        self,
        store: Store,
        catalog: Catalog,
        submissions: Submissions,
        board: FutureBoard,
        health: Callable[[], Awaitable[dict[str, str]]],
        queue_state: Callable[[str], tuple[str, str]] = lambda model_id: ("active", ""),
    ) -> None:
        self.queue_state = queue_state
        self.store = store
        self.catalog = catalog
        self.submissions = submissions
        self.board = board
        self.health = health

    # ---------------------------------------------------------------- sessions
    @grpc_errors
    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateSessionReply:
        rec = await self.catalog.create_session(
            request.owner,
            list(request.tags),
            dict(request.user_metadata),
            request.display_name if request.HasField("display_name") else None,
            request.project_id if request.HasField("project_id") else None,
        )
        log.info("session %s created", rec.session_id)
        return pb.CreateSessionReply(session_id=rec.session_id)

    @grpc_errors
    async def Heartbeat(
        self, request: pb.SessionRef, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatReply:
        return pb.HeartbeatReply(
            finished=await self.catalog.heartbeat(request.owner, request.session_id)
        )

    @grpc_errors
    async def FinishSession(
        self, request: pb.SessionRef, context: grpc.aio.ServicerContext
    ) -> pb.Empty:
        await self.catalog.finish_session(request.owner, request.session_id)
        return pb.Empty()

    @grpc_errors
    async def GetSession(
        self, request: pb.SessionRef, context: grpc.aio.ServicerContext
    ) -> pb.SessionInfo:
        rec = await self.catalog.owned_session(request.owner, request.session_id)
        models, samplers = await self.store.session_members(rec.session_id)
        info = pb.SessionInfo(
            training_run_ids=models, sampler_ids=samplers, user_metadata=rec.user_metadata
        )
        if rec.display_name is not None:
            info.display_name = rec.display_name
        return info

    @grpc_errors
    async def GetSessionTrace(
        self, request: pb.SessionRef, context: grpc.aio.ServicerContext
    ) -> pb.SessionTrace:
        rec = await self.catalog.owned_session(request.owner, request.session_id)  # else 404
        trace = await tracing.export(rec.session_id)
        return pb.SessionTrace(trace_json=json.dumps(trace).encode())

    @grpc_errors
    async def ListSessions(
        self, request: pb.ListRequest, context: grpc.aio.ServicerContext
    ) -> pb.SessionList:
        ids, total = await self.store.owner_sessions(
            request.owner, request.offset, request.limit or 20
        )
        return pb.SessionList(session_ids=ids, total_count=total)

    @grpc_errors
    async def CreateCustomLoss(
        self, request: pb.CreateCustomLossRequest, context: grpc.aio.ServicerContext
    ) -> pb.SubmitReply:
        return await self.submissions.custom_losses.create(request)

    # ---------------------------------------------------------------- futures
    @grpc_errors
    async def Submit(
        self, request: pb.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> pb.SubmitReply:
        return await self.submissions.submit(request)

    @grpc_errors
    async def RetrieveFuture(
        self, request: pb.RetrieveFutureRequest, context: grpc.aio.ServicerContext
    ) -> pb.FutureReply:
        timeout = min(max(request.timeout_seconds, 0.0), MAX_POLL_SECONDS)
        with metrics.FUTURE_WAITERS.track_inprogress():
            try:
                job = await self.board.wait(request.request_id, timeout)
            except redis_conn.UNAVAILABLE_ERRORS as exc:  # the result is safe in Redis: poll again
                log.warning("RetrieveFuture: redis unavailable: %s", exc)
                return pb.FutureReply(
                    try_again=pb.TryAgain(queue_state="active", reason="state store restarting")
                )
        if job is None or job.owner != request.owner:
            raise NotFound(f"request {request.request_id} does not exist")
        if job.status == JobStatus.PENDING:
            state, reason = self.queue_state(job.model_id)
            return pb.FutureReply(try_again=pb.TryAgain(queue_state=state, reason=reason))
        if job.status == JobStatus.FAILED:
            return pb.FutureReply(
                error=pb.JobError(message=job.error or "failed", category=job.category or "unknown")
            )
        return pb.FutureReply(result=pb.JobResult.FromString(job.result or b""))

    @grpc_errors
    async def RetrieveFutures(
        self, request: pb.RetrieveFuturesRequest, context: grpc.aio.ServicerContext
    ) -> pb.RetrieveFuturesReply:
        sampler = await self.catalog.owned_sampler(request.owner, request.sampler_id)
        timeout = min(max(request.timeout_seconds, 0.0), MAX_POLL_SECONDS)

        async def read() -> sample_futures.Completions:
            return await sample_futures.since(
                self.store, sampler.sampler_id, request.clone, request.prev_cursor
            )

        try:
            with metrics.FUTURE_WAITERS.track_inprogress():
                found = await self.board.wait_until(
                    sample_futures.topic(sampler.sampler_id, request.clone),
                    read,
                    lambda c: bool(c.entries),
                    timeout,
                )
        except sample_futures.CursorAhead as exc:
            raise UserInputError("prev_cursor", str(exc)) from exc
        return pb.RetrieveFuturesReply(completions=found.entries, cursor=found.cursor)

    @grpc_errors
    async def CancelFuture(
        self, request: pb.CancelFutureRequest, context: grpc.aio.ServicerContext
    ) -> pb.CancelFutureReply:
        job = await self.store.job(request.request_id, payload=False)
        if job is None or job.owner != request.owner:
            raise NotFound(f"request {request.request_id} does not exist")
        if job.kind != OpKind.SAMPLE:
            raise UserInputError(
                "request_id",
                f"{request.request_id} is a {job.kind} request: only samples can be cancelled "
                "(a model's training requests run in seq_id order)",
            )
        outcome = await sample_futures.cancel(self.store, job)
        if outcome == sample_futures.Outcome.CANCELLED:
            self.board.notify(job.request_id, sample_futures.job_topic(job))
            log.info("sample %s cancelled by its client", job.request_id)
        return pb.CancelFutureReply(outcome=outcome.value)

    # ---------------------------------------------------------------- models and samplers
    @grpc_errors
    async def GetModelInfo(
        self, request: pb.ModelRef, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
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
        )

    @grpc_errors
    async def CreateSamplingSession(
        self, request: pb.CreateSamplingSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.SamplerInfo:
        rec = await self.catalog.create_sampler(
            request.owner,
            request.session_id,
            request.sampling_session_seq_id,
            request.model_path if request.HasField("model_path") else None,
            request.base_model if request.HasField("base_model") else None,
        )
        return self._sampler_info(rec)

    @grpc_errors
    async def GetSampler(
        self, request: pb.SamplerRef, context: grpc.aio.ServicerContext
    ) -> pb.SamplerInfo:
        return self._sampler_info(
            await self.catalog.owned_sampler(request.owner, request.sampler_id)
        )

    @grpc_errors
    async def JoinSamplingSession(
        self, request: pb.SamplerRef, context: grpc.aio.ServicerContext
    ) -> pb.JoinSamplingSessionReply:
        sampler = await self.catalog.owned_sampler(request.owner, request.sampler_id)
        clone = await sample_futures.join(self.store, sampler.sampler_id)
        return pb.JoinSamplingSessionReply(client_counter=clone)

    @staticmethod
    def _sampler_info(rec: SamplerRecord) -> pb.SamplerInfo:
        info = pb.SamplerInfo(sampler_id=rec.sampler_id, base_model=rec.base_model)
        if rec.model_path:
            info.model_path = rec.model_path
        return info

    @grpc_errors
    async def GetServerCapabilities(
        self, request: pb.CapabilitiesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerCapabilities:
        ctx = self.catalog.card.max_context_length
        per_datum = self.submissions.max_tokens_per_datum()
        budget = self.submissions.memory.budget_bytes
        loss = self.submissions.custom_losses.bound
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
                )
                for n in self.catalog.served_names
            ]
        )

    # ---------------------------------------------------------------- runs and checkpoints
    async def _run(self, model: ModelRecord) -> pb.TrainingRun:
        last = await self.store.last_request_time(model.model_id) or model.last_request_time
        run = pb.TrainingRun(
            training_run_id=model.model_id,
            base_model=model.base_model,
            model_owner=model.owner,
            is_lora=True,
            last_request_time=last,
            lora_rank=model.lora.rank,
            user_metadata=model.user_metadata,
        )
        for cid, slot in (
            (model.last_checkpoint, run.last_checkpoint),
            (model.last_sampler_checkpoint, run.last_sampler_checkpoint),
        ):
            rec = await self.store.checkpoint(model.model_id, cid) if cid else None
            if rec is not None:
                slot.CopyFrom(checkpoint_pb(rec))
        return run

    @grpc_errors
    async def ListTrainingRuns(
        self, request: pb.ListRequest, context: grpc.aio.ServicerContext
    ) -> pb.TrainingRunList:
        ids, total = await self.store.owner_runs(request.owner, request.offset, request.limit or 20)
        runs = [await self._run(await self.catalog.owned_model(request.owner, i)) for i in ids]
        return pb.TrainingRunList(runs=runs, total_count=total)

    @grpc_errors
    async def GetTrainingRun(
        self, request: pb.RunRef, context: grpc.aio.ServicerContext
    ) -> pb.TrainingRun:
        return await self._run(await self.catalog.owned_model(request.owner, request.run_id))

    @grpc_errors
    async def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckpointList:
        run_id = request.run_id if request.HasField("run_id") else None
        recs = await self.catalog.list_checkpoints(request.owner, run_id)
        limit = request.limit or len(recs)
        page = recs[request.offset : request.offset + limit]
        return pb.CheckpointList(
            checkpoints=[checkpoint_pb(r) for r in page], total_count=len(recs)
        )

    @grpc_errors
    async def DeleteCheckpoint(
        self, request: pb.CheckpointRef, context: grpc.aio.ServicerContext
    ) -> pb.Empty:
        await self.catalog.delete_checkpoint(request.owner, request.tinker_path)
        return pb.Empty()

    @grpc_errors
    async def SetCheckpointPublic(
        self, request: pb.SetCheckpointPublicRequest, context: grpc.aio.ServicerContext
    ) -> pb.Empty:
        await self.catalog.set_public(request.ref.owner, request.ref.tinker_path, request.public)
        return pb.Empty()

    @grpc_errors
    async def SetCheckpointTtl(
        self, request: pb.SetCheckpointTtlRequest, context: grpc.aio.ServicerContext
    ) -> pb.Empty:
        ttl = request.ttl_seconds if request.HasField("ttl_seconds") else None
        await self.catalog.set_ttl(request.ref.owner, request.ref.tinker_path, ttl)
        return pb.Empty()

    @grpc_errors
    async def GetCheckpointFiles(
        self, request: pb.CheckpointRef, context: grpc.aio.ServicerContext
    ) -> pb.CheckpointFiles:
        directory, files = await self.catalog.checkpoint_files(request.owner, request.tinker_path)
        return pb.CheckpointFiles(
            directory=str(directory), relative_paths=files, expires=time.time() + 3600
        )

    @grpc_errors
    async def GetWeightsInfo(
        self, request: pb.CheckpointRef, context: grpc.aio.ServicerContext
    ) -> pb.WeightsInfo:
        path = TinkerPath.parse(request.tinker_path, "tinker_path")
        await self.catalog.readable_checkpoint(request.owner, path, field="tinker_path")
        model = await self.store.model(path.model_id)
        if model is None:
            raise NotFound(f"training run {path.model_id} does not exist")
        return pb.WeightsInfo(base_model=model.base_model, is_lora=True, lora_config=lora_pb(model))

    async def Health(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.HealthReply:
        parts = await self.health()
        return pb.HealthReply(ready=all(v == "ready" for v in parts.values()), parts=parts)
