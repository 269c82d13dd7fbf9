"""Submissions and their futures: Submit, CreateCustomLoss, RetrieveFuture(s), CancelFuture."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from lockstep.errors import UserInputError
from lockstep.observability import metrics
from lockstep.scheduler.admission.submissions import Submissions
from lockstep.scheduler.api.audit import AuditTrail
from lockstep.scheduler.api.servicer import Handler
from lockstep.scheduler.ops import registry
from lockstep.scheduler.state import redis_conn, sample_futures
from lockstep.scheduler.state.catalog import Catalog, NotFound
from lockstep.scheduler.state.futures import FutureBoard
from lockstep.scheduler.state.jobs import Job
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import JobStatus, OpKind

log = logging.getLogger(__name__)

# The gateway's long-poll must answer before the SDK's 45 s read timeout.
MAX_POLL_SECONDS = 30.0


class FutureRpcs:
    def __init__(
        self,
        store: Store,
        catalog: Catalog,
        submissions: Submissions,
        board: FutureBoard,
        trail: AuditTrail,
        queue_state: Callable[[str], tuple[str, str]],
    ) -> None:
        self.store = store
        self.catalog = catalog
        self.submissions = submissions
        self.board = board
        self.trail = trail
        self.queue_state = queue_state

    def rpcs(self) -> Mapping[str, Handler]:
        return {
            "Submit": self.submit,
            "CreateCustomLoss": self.submissions.custom_losses.create,
            "RetrieveFuture": self.retrieve_future,
            "RetrieveFutures": self.retrieve_futures,
            "CancelFuture": self.cancel_future,
        }

    async def submit(self, request: pb.SubmitRequest) -> pb.SubmitReply:
        reply = await self.submissions.submit(request)
        # The job is queued: its audit entry is best effort from here (AuditTrail).
        entry = registry.arriving_as(request.WhichOneof("op")).audit(request, reply)
        if entry is not None:
            await self.trail.record(request.owner, entry.event, **entry.details)
        return reply

    async def retrieve_future(self, request: pb.RetrieveFutureRequest) -> pb.FutureReply:
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
        return finished_reply(job)

    async def retrieve_futures(self, request: pb.RetrieveFuturesRequest) -> pb.RetrieveFuturesReply:
        timeout = min(max(request.timeout_seconds, 0.0), MAX_POLL_SECONDS)

        async def read() -> sample_futures.Completions:
            # The ownership check and the read are one script: one round trip per read.
            found = await sample_futures.since(
                self.store, request.owner, request.sampler_id, request.clone, request.prev_cursor
            )
            if found is None:
                raise NotFound(f"sampler {request.sampler_id} does not exist")
            return found

        try:
            with metrics.FUTURE_WAITERS.track_inprogress():
                found = await self.board.wait_until(
                    sample_futures.topic(request.sampler_id, request.clone),
                    read,
                    lambda c: bool(c.entries),
                    timeout,
                    sample_futures.handed,
                )
        except sample_futures.CursorAhead as exc:
            raise UserInputError("prev_cursor", str(exc)) from exc
        for entry in found.entries:
            job = found.answers.get(entry.request_id)
            if job is not None and job.status != JobStatus.PENDING:
                entry.answer.CopyFrom(finished_reply(job))
        return pb.RetrieveFuturesReply(completions=found.entries, cursor=found.cursor)

    async def cancel_future(self, request: pb.CancelFutureRequest) -> pb.CancelFutureReply:
        job = await self.store.jobs.get(request.request_id, payload=False)
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
            self.board.cancelled(job.request_id, sample_futures.job_topic(job))
            log.info("sample %s of %s cancelled by its client", job.request_id, job.model_id)
        return pb.CancelFutureReply(outcome=outcome.value)


def finished_reply(job: Job) -> pb.FutureReply:
    """What a finished (done or failed) job's future answers."""
    if job.status == JobStatus.FAILED:
        return pb.FutureReply(
            error=pb.JobError(message=job.error or "failed", category=job.category or "unknown")
        )
    return pb.FutureReply(result=pb.JobResult.FromString(job.result or b""))
